"""The default calibration text: `lmjax convert --quant w4` (GPTQ and AWQ need sample inputs of every layer)
and the int4 KV cache's per-layer K/q maps (lmjax.models.kv_calibration, computed when an engine starts).

Mixed registers on purpose (narrative prose, exposition, dialogue, lists, code), so the activation
statistics are not those of one style. Public-domain openings (Austen 1813, Dickens 1859, Melville
1851, the US Constitution's preamble 1787) and prose and code written for lmjax. Deliberately disjoint
from tests/convert/data/perplexity.txt (the evaluation text): calibrating on the text that is then
scored would flatter the quantizer. Kept as a module constant so it ships inside the wheel.
"""

DEFAULT_CALIBRATION_TEXT = """\
It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife. However little known the feelings or views of such a man may be on his first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered as the rightful property of some one or other of their daughters.

It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had everything before us, we had nothing before us.

Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my purse, and nothing particular to interest me on shore, I thought I would sail about a little and see the watery part of the world. It is a way I have of driving off the spleen, and regulating the circulation.

We the People of the United States, in Order to form a more perfect Union, establish Justice, insure domestic Tranquility, provide for the common defence, promote the general Welfare, and secure the Blessings of Liberty to ourselves and our Posterity, do ordain and establish this Constitution for the United States of America.

Water moves through the world in a cycle that has no beginning and no end. Sunlight warms the surface of the ocean, and some of the water evaporates into the air as an invisible gas. As the warm, moist air rises, it cools, and the vapour condenses into tiny droplets that gather around specks of dust and salt. Billions of these droplets make a cloud. When the droplets collide and grow heavy enough, they fall as rain or snow. Some of that water soaks into the ground and feeds springs and wells; some runs off into streams and rivers that carry it back to the sea, where the cycle begins again.

A good loaf of bread needs only four ingredients: flour, water, salt and yeast. Mix 500 grams of flour with 350 grams of lukewarm water and let the dough rest for twenty minutes. Add 10 grams of salt and 5 grams of dried yeast, then knead for about ten minutes, until the dough is smooth and springs back when pressed. Cover the bowl and leave it somewhere warm for an hour or two, until it has doubled in size. Shape it into a round, let it rise once more, and bake it at 230 degrees Celsius for 35 to 40 minutes. The loaf is done when it sounds hollow when tapped on the bottom.

"Where are you going?" asked the old fisherman, looking up from his nets.
"To the lighthouse," said the girl. "My brother says the keeper has a telescope, and that on a clear night you can see the rings of Saturn."
"Your brother is right," he said, and smiled. "But the path is steep, and the wind will be strong after dark. Take a lantern, and come back before the tide turns."
She thanked him, tied her scarf tighter, and began to climb.

The history of computing is full of machines that were built to solve one problem and ended up solving many others. Early mechanical calculators could add and subtract; later designs used punched cards to store both data and instructions. In the twentieth century, engineers replaced gears with vacuum tubes, then with transistors, and finally with integrated circuits holding billions of switches on a chip smaller than a fingernail. Each step made computers faster, cheaper and smaller, and each step opened new uses that their inventors had not imagined.

Things to pack for a weekend in the mountains:
1. A warm jacket and a waterproof shell.
2. Sturdy boots that have already been worn in.
3. A map, a compass, and a fully charged phone.
4. Two litres of water per person, and snacks such as nuts, dried fruit and chocolate.
5. A small first-aid kit with plasters, bandages and pain relief.
6. A headlamp with spare batteries.

Question: What is the difference between weather and climate?
Answer: Weather is the state of the atmosphere at a particular place and time: whether it is sunny, rainy, windy, hot or cold today. Climate is the average pattern of weather in a region over many years, usually thirty or more. A single cold day says little about the climate, but a steady rise in average temperatures over decades does.

def merge_sorted(a, b):
    \"\"\"Merge two sorted lists into one sorted list.\"\"\"
    result, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            result.append(a[i])
            i += 1
        else:
            result.append(b[j])
            j += 1
    result.extend(a[i:])
    result.extend(b[j:])
    return result


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, word):
        self.counts[word] = self.counts.get(word, 0) + 1

    def most_common(self, n=3):
        return sorted(self.counts.items(), key=lambda kv: -kv[1])[:n]

Photosynthesis is the process by which green plants turn light into chemical energy. Inside the leaves, chlorophyll absorbs red and blue light and uses its energy to split water molecules, releasing oxygen. The hydrogen and the captured energy are then used to turn carbon dioxide from the air into sugars, which the plant uses to grow and to store energy for later. Almost all life on Earth depends, directly or indirectly, on this reaction.

The town council met on Tuesday evening to discuss the new library. After two hours of debate, members voted seven to two in favour of the plan, which will convert the old railway station into a public reading room with a children's corner, study desks and free internet access. Construction is expected to begin in the spring and to take about eighteen months.

In mathematics, a prime number is a whole number greater than one whose only divisors are one and itself. The first few primes are 2, 3, 5, 7, 11, 13, 17, 19, 23 and 29. Euclid proved more than two thousand years ago that there are infinitely many of them: if there were only finitely many, multiplying them all together and adding one would give a number that none of them divides.

Dear Maria,
Thank you for your letter and for the photographs of the garden. The roses look wonderful, and I can hardly believe how tall the sunflowers have grown. Here the autumn has arrived early; the mornings are cold and the leaves are already turning. I hope to visit you in December, if the trains are running. Give my love to everyone.
With warm wishes,
Thomas
"""
