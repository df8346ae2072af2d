"""The server's CORS settings and their command-line options (argparse only: `lmjax --help` imports no
FastAPI). LMDeploy's api_server spells them `--allow-origins`, `--allow-credentials`, `--allow-methods`,
`--allow-headers`; vLLM's `--allowed-origins`, ... (both spellings are taken). Both servers allow every
origin, method and header without credentials by default, and so does lmjax (lmjax.serve.http_extras)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import re

# an Origin header's value: scheme://host[:port] (no path), or "null" (file:// pages, sandboxed frames)
_ORIGIN = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/\s]+$")


@dataclasses.dataclass(frozen=True)
class CorsConfig:
    allow_origins: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    allow_methods: tuple[str, ...] = ("*",)
    allow_headers: tuple[str, ...] = ("*",)

    def __post_init__(self):
        for name in ("allow_origins", "allow_methods", "allow_headers"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        bad = [o for o in self.allow_origins if o not in ("*", "null") and not _ORIGIN.match(o)]
        if bad:  # (also catches `--allow-origins URL MODEL`: nargs="+" swallowed the model)
            raise ValueError(f"allow_origins: {bad[0]!r} is not an origin ('*' or scheme://host[:port], no path)")
        if self.allow_credentials and "*" in self.allow_origins:
            # Starlette would then echo any Origin with credentials allowed: every site could act with a
            # user's cookies on this server. Browsers refuse "*" with credentials for the same reason.
            raise ValueError("allow_credentials needs explicit allow_origins, not '*' "
                             f"(allow_origins={list(self.allow_origins)})")


def add_cors_args(p: argparse.ArgumentParser) -> None:
    for ours, vllms, what in (("--allow-origins", "--allowed-origins", "origins"),
                              ("--allow-methods", "--allowed-methods", "HTTP methods"),
                              ("--allow-headers", "--allowed-headers", "request headers")):
        dest = ours[2:].replace("-", "_")
        p.add_argument(ours, vllms, dest=dest, nargs="+", type=_item, action=_Flatten, default=["*"],
                       metavar="X", help=f"CORS: {what} browsers may use (default: *; vLLM's JSON list too)")
    p.add_argument("--allow-credentials", "--allowed-credentials", dest="allow_credentials", action="store_true",
                   help="CORS: allow cookies / auth headers from the allowed origins (needs explicit origins)")


def cors_from_args(args) -> CorsConfig:
    return CorsConfig(args.allow_origins, args.allow_credentials, args.allow_methods, args.allow_headers)


def _item(text: str) -> list[str]:
    """One value, or vLLM's JSON list of them ('["http://a", "http://b"]')."""
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {text!r} ({e})") from None
        if not (isinstance(items, list) and all(isinstance(i, str) for i in items)):
            raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
        return items
    return [text]


class _Flatten(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, [v for group in values for v in group])
