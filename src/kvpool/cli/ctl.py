"""`kvpool ctl`: the client of a `kvpool server`'s controller (docs/control.md).

    kvpool ctl --url http://127.0.0.1:9400 usage
    kvpool ctl --url ... lookup --model /models/llama --block-size 128 --prompt "You are ..."
    kvpool ctl --url ... pin    --model /models/llama --block-size 128 --prompt-file system.txt --ttl 1h
    kvpool ctl --url ... clear  --model /models/llama

The token is read from the environment (the server's variable), never from the command line,
where other users of the host could read it. A prompt given as text is tokenized with the
model's tokenizer as vLLM's completions API does (special tokens added); its block hashes are
computed by vLLM itself, so they are the instance's (the same `--block-size`,
`--prefix-caching-hash-algo`, `cache_salt` and `PYTHONHASHSEED` as the instance).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from kvpool.cli.doctor import HASH_ALGOS
from kvpool.cli.inputs import InputError, read_file
from kvpool.config import parse_duration
from kvpool.errors import ConfigError
from kvpool.keys import model_key_name
from kvpool.server.metrics import ADMIN_TOKEN_ENV

TIMEOUT_S = 120.0  # a clear of a million keys takes seconds; a hung server must not hang us


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True,
                   help="the server's HTTP endpoint (its --metrics-host and --metrics-port), e.g. http://127.0.0.1:9400")
    sub = p.add_subparsers(dest="call", metavar="CALL", required=True, help="the controller call")
    sub.add_parser("usage", help="objects and bytes per model and tier")
    for name, text in (("lookup", "how many of a prompt's blocks the pool holds, per tier"),
                       ("pin", "keep a prompt's blocks in memory for --ttl"),
                       ("unpin", "end a prompt's pins")):
        q = sub.add_parser(name, help=text, description=text)
        _add_prompt_arguments(q)
        if name == "pin":
            q.add_argument("--ttl", required=True, help='how long, e.g. "90s", "30m", "2h" (at most 7 days)')
    q = sub.add_parser("clear", help="remove one model's blocks, one tenant's, or every block")
    which = q.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="the model as the instances were given it (vLLM's --model)")
    which.add_argument("--cache-salt", help="a tenant's blocks: those of requests with this cache_salt")
    which.add_argument("--tenant", help="a tenant's blocks, by its name in the server's --tenants-file")
    which.add_argument("--all", action="store_true", help="every block of every model")


def _add_prompt_arguments(q: argparse.ArgumentParser) -> None:
    q.add_argument("--model", required=True, help="the model as the instances were given it (vLLM's --model)")
    prompt = q.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt's text")
    prompt.add_argument("--prompt-file", help="a file holding the prompt's text")
    prompt.add_argument("--token-ids", help="the prompt's token ids, comma-separated")
    prompt.add_argument("--block-hashes", help="the prompt's block hashes (hex), comma-separated")
    q.add_argument("--block-size", type=int, help="the instances' KV block size in tokens (vLLM's --block-size)")
    q.add_argument("--hash-algo", default="sha256", choices=HASH_ALGOS,
                   help="the instances' --prefix-caching-hash-algo (default sha256)")
    q.add_argument("--cache-salt", help="the requests' cache_salt, if they carry one")
    q.add_argument("--tokenizer", help="tokenizer for --prompt (default: --model)")


def block_hashes(args: argparse.Namespace) -> list[str]:
    """The prompt's block hashes, hex, from whichever form it was given in."""
    if args.block_hashes:
        return [h.strip().lower() for h in args.block_hashes.split(",") if h.strip()]
    if not args.block_size or args.block_size < 1:
        raise InputError("--block-size is needed to hash a prompt: the instances' KV block size (vLLM's "
                         "--block-size; its default is 16 on GPUs and 128 on CPUs)")
    if args.token_ids:
        try:
            ids = [int(t) for t in args.token_ids.split(",") if t.strip()]
        except ValueError:
            raise InputError(f"--token-ids={args.token_ids[:60]!r}: expected integers, comma-separated") from None
    else:
        text = args.prompt if args.prompt is not None else read_file(args.prompt_file, 64 << 20)
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(args.tokenizer or args.model).encode(text)
    from kvpool.vllm.prompt_hashes import prompt_block_hashes

    hashes = prompt_block_hashes(ids, args.block_size, args.hash_algo, args.cache_salt)
    if not hashes:
        raise InputError(f"the prompt has {len(ids)} tokens: not one whole block of {args.block_size}; "
                         "the pool holds whole blocks only")
    return [h.hex() for h in hashes]


def request(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None]:
    """The call's method, route and JSON body."""
    if args.call == "usage":
        return "GET", "/v1/usage", None
    if args.call == "clear":
        body: dict[str, Any] = (
            {"all": True} if args.all else {"cache_salt": args.cache_salt} if args.cache_salt is not None
            else {"tenant": args.tenant} if args.tenant is not None else {"model": model_key_name(args.model)})
        return "POST", "/v1/clear", body
    body = {"model": model_key_name(args.model), "block_hashes": block_hashes(args)}
    if args.cache_salt:
        body["cache_salt"] = args.cache_salt
    if args.call == "pin":
        body["ttl_s"] = parse_duration("--ttl", args.ttl, 1.0, 'a duration such as "90s", "30m" or "2h"')
    return "POST", f"/v1/{args.call}", body


def run(args: argparse.Namespace) -> int:
    from kvpool.cli.inputs import http_request

    try:
        method, route, body = request(args)
        token = os.environ.get(ADMIN_TOKEN_ENV, "")
        if not token:
            raise InputError(f"set {ADMIN_TOKEN_ENV} to the server's admin token (the value it was started with)")
        status, answer = http_request(args.url.rstrip("/") + route, TIMEOUT_S, method,
                                      None if body is None else json.dumps(body).encode(),
                                      {"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    except (InputError, ConfigError, OSError) as exc:
        print(f"kvpool ctl {args.call}: {exc}", file=sys.stderr)
        return 1
    try:
        parsed = json.loads(answer)
    except ValueError:
        parsed = {"error": answer[:200].decode(errors="replace")}
    if status != 200:
        print(f"kvpool ctl {args.call}: HTTP {status}: {parsed.get('error', parsed)}", file=sys.stderr)
        return 1
    print(json.dumps(parsed, indent=2, sort_keys=True))
    return 0
