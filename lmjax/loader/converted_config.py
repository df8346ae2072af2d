"""The entry `lmjax convert` adds to a converted directory's config.json, in a module of its own so that every
loader can read it (orbax_loader imports model_loader, which imports awq: awq cannot import orbax_loader)."""
from __future__ import annotations

CONFIG_KEY = "lmjax"  # config.json's entry: {"format": .., "quant": {...}, "tp": ..}


def conversion_info(hf_config: dict) -> dict:
    """The conversion's entry of a config.json ({} for a checkpoint lmjax did not convert)."""
    return hf_config.get(CONFIG_KEY) or {}


def converted_quant(hf_config: dict) -> dict | None:
    """The quant record of a conversion's weights (QuantSpec.to_dict()'s fields), None for float weights."""
    return conversion_info(hf_config).get("quant")
