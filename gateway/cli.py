"""`strata serve`, `strata build-model`, `strata cluster up`, `strata keys rotate` and `strata what-if`."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from .checkpoints import BUILDABLE_FAMILIES, DEFAULT_FAMILY, DTYPES, SIZES
from .settings import SETTINGS, Settings, add_setting_flags, default_data_dir


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description="Strata: a caching gateway for multimodal LLMs")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible gateway")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--model",
        action="append",
        help="'demo' or 'tiny' (built in), '<family>-demo' / '<family>-tiny' for another built-in family, "
        "a model folder, or a hub id (default demo, unless STRATA_MODELS_FILE names the models); give it "
        "again to serve several models: the first is loaded at start, the others when first asked for",
    )
    serve.add_argument(
        "--data-dir", type=Path, default=default_data_dir(), help="default: STRATA_DATA_DIR, else ./strata-data"
    )
    serve.add_argument("--log-level", default="info")
    add_setting_flags(serve)
    build = commands.add_parser("build-model", help="build a seeded random-init model folder of one family")
    build.add_argument(
        "--family",
        choices=BUILDABLE_FAMILIES,
        default=DEFAULT_FAMILY,
        help="the library's own model_type (default %(default)s)",
    )
    build.add_argument("--size", choices=sorted(SIZES), default="tiny")
    build.add_argument("--dtype", choices=DTYPES, default="float32")
    build.add_argument(
        "--quantize", type=int, choices=(4, 8), default=None, help="quantise the language model's weights"
    )
    build.add_argument(
        "--ends-turns",
        action="store_true",
        help="the agents' test model: answers end after a few sampled tokens, 128k positions",
    )
    build.add_argument("--out", type=Path, required=True)
    cluster = commands.add_parser("cluster", help="Redis, two replicas and HAProxy on loopback (Ctrl-C stops them)")
    cluster.add_argument("action", choices=["up"])
    cluster.add_argument("--model", default="demo")
    cluster.add_argument("--port", type=int, default=8000, help="the proxy's; the replicas take the next two")
    cluster.add_argument("--data-dir", type=Path, default=Path("strata-data") / "cluster")
    keys = commands.add_parser("keys", help="the data keys of encryption at rest")
    keys.add_argument("action", choices=["rotate"], help="rotate: wrap every tenant's data key under a new key file")
    keys.add_argument("--new-key-file", type=Path, required=True, help="32 random bytes, raw or as 64 hex digits")
    keys.add_argument("--data-dir", type=Path, default=default_data_dir())
    what_if = commands.add_parser("what-if", help="the prefix hit rate a trace would get at other cache sizes")
    what_if.add_argument("--trace", type=Path, required=True, help="a STRATA_TRACE_FILE")
    what_if.add_argument("--block-bytes", type=int, default=0, help="one block's KV bytes (admin stats), for GiB")
    cost = (
        "per token, from the server's start-up log line 'SSD tier: reading a token's KV takes R us, computing it C us'"
    )
    what_if.add_argument("--prefill-us", type=float, default=0.0, help=f"C: computing a token's KV, us {cost}")
    what_if.add_argument("--ssd-read-us", type=float, default=0.0, help=f"R: reading a token's KV from SSD, us {cost}")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.command == "cluster":
        from .operations.cluster import run

        return run(args.model, args.data_dir, args.port)
    if args.command == "keys":
        return _rotate_keys(args.data_dir, args.new_key_file)
    if args.command == "what-if":
        from .operations.whatif import Costs, what_if

        return what_if(args.trace, Costs(args.block_bytes, args.prefill_us, args.ssd_read_us))
    if args.command == "build-model":
        from .checkpoints import BuildSpec, build_model

        print(build_model(BuildSpec(args.family, args.size, args.dtype, args.quantize, args.ends_turns), args.out))
        return 0
    from .blas import reexec_with_openblas

    reexec_with_openblas(argv)  # returns only if already on OpenBLAS (or none can be had)
    return _serve(args)


def _configure_logging(level: str, log_format: str) -> None:
    if log_format == "json":
        from .observability.requestlog import JsonFormatter

        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter())
        logging.basicConfig(level=level.upper(), handlers=[handler])
    else:
        logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _rotate_keys(data_dir: Path, new_key_file: Path) -> int:
    """Wrap the data keys of the key store the environment names (STRATA_KEY_FILE, STRATA_REDIS_URL,
    STRATA_SECRET_FILE, as the servers see them) under the new key. Servers may be running: they
    follow once their STRATA_KEY_FILE holds the new key."""
    from kvcache.sealing import StoreUnavailable, Unreadable

    from .settings import settings_from_env
    from .tenancy.keyring import rotate

    try:
        count = rotate(settings_from_env("demo", data_dir, "127.0.0.1", 0), new_key_file)
    except (RuntimeError, ValueError, StoreUnavailable, Unreadable) as exc:
        print(f"strata: keys not rotated (the key store is unchanged): {exc}", file=sys.stderr)
        return 2
    print(
        f"{count} tenant keys wrapped under {new_key_file}; running servers follow once the file their "
        f"STRATA_KEY_FILE names holds this key (mv {new_key_file} there); start new ones with it"
    )
    return 0


def serve_settings(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Settings:
    """What `strata serve ARGS` would serve, from its flags and the environment (os.environ unless
    given), before anything starts: ValueError names a bad setting, a repeated model name or a bad
    models file."""
    from .serving.models import model_entries
    from .settings import settings_from_env

    flags = {s.field: getattr(args, s.field) for s in SETTINGS if s.flag}
    models = args.model or [""]
    settings = settings_from_env(
        models[0], args.data_dir, args.host, args.port, env, flags, more_models=tuple(models[1:])
    )
    if not args.model and not settings.models_file:  # no model named anywhere: the built-in demo
        settings = dataclasses.replace(settings, model="demo")
    model_entries(settings)
    return settings


def _serve(args: argparse.Namespace) -> int:
    from .http.app import create_app
    from .http.server import serve

    os.umask(0o077)  # everything the server writes holds tenants' data: owner-only (gateway/tenancy/files.py)
    try:
        settings = serve_settings(args)
    except ValueError as exc:
        print(f"strata: {exc}", file=sys.stderr)
        return 2
    _configure_logging(args.log_level, settings.log_format)
    from .engine import map_large_allocations
    from .tenancy.keyring import keyring_for

    map_large_allocations()  # what one large request allocates goes back to the system after it

    try:
        keyring_for(settings)
    except RuntimeError as exc:
        print(f"strata: cannot open the data keys: {exc}", file=sys.stderr)
        return 2
    if settings.public_prefixes_file is not None:
        from .tenancy.public_prefixes import load_file

        try:
            load_file(settings.public_prefixes_file)
        except ValueError as exc:
            print(f"strata: {exc}", file=sys.stderr)
            return 2
    from .engine import UnsupportedModel, family_of
    from .serving.models import model_entries

    for entry in model_entries(settings):
        if Path(entry.path).is_dir():  # a local folder: refuse an unsupported family before anything loads
            try:
                family_of(Path(entry.path))
            except (UnsupportedModel, OSError, ValueError) as exc:
                print(f"strata: cannot serve {entry.path}: {exc}", file=sys.stderr)
                return 2
    serve(create_app(settings), settings, args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
