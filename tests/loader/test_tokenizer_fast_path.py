"""A checkpoint whose tokenizer is transformers' plain fast tokenizer loads without AutoTokenizer (whose
import pulls in torch: seconds of an engine's start) and behaves exactly like AutoTokenizer's."""
import subprocess
import sys

from transformers import AutoTokenizer

from lmjax.loader.tokenizer import load_tokenizer

sys.path.insert(0, "benchmarks")
from random_model import write_tokenizer  # noqa: E402


def test_plain_fast_tokenizer_matches_auto_tokenizer_without_torch(tmp_path):
    write_tokenizer(300, str(tmp_path))
    ours, auto = load_tokenizer(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(ours) is type(auto)
    text = "t5 t77 t299 t300 word"
    assert ours.encode(text) == auto.encode(text)
    assert ours.decode(ours.encode(text)) == auto.decode(auto.encode(text))
    assert (ours.eos_token_id, ours.bos_token_id) == (auto.eos_token_id, auto.bos_token_id)
    probe = ("import sys; from lmjax.loader.tokenizer import load_tokenizer; "
             f"load_tokenizer({str(tmp_path)!r}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
