#!/usr/bin/env python3
"""What a credential costs the broker (QUEEN_AUTH=jwt): its CPU per request, from /proc,
for DELETEs of an absent key from one keep-alive client, by credential, in the same run.
The credential is checked before the tenant's turn (turns.py), so whatever checking it costs
is spent before any fairness applies: a client without a valid token must not be able to
make the broker spend more on its 401 than it spends serving a tenant's request.

    .venv/bin/python bench/jwt_cost.py [--rounds 4] [--n 2000] [--key secret|rsa|ed25519]
                                       [--compare /path/to/other/checkout]

Credentials: a valid token (HS256 under QUEEN_JWT_SECRET, or with --key RS256 / EdDSA under
QUEEN_JWT_PUBLIC_KEY), the same padded to 7.5 KB (within QUEEN_JWT_MAX_BYTES' default of 8 KiB),
a token of another secret or key at both sizes, and one of 13 KB, each repeated for a round (the
broker remembers a token it refused for good, so from the second request such a token costs a
digest and a lookup), and a token of another key that is new at every request (what a client
varying its bad tokens makes the broker spend: a signature check each). Target: every 401's CPU
<= 1.5x the valid token's request; every valid token's request <= 1.5x the small one's. With
--compare, a broker of that checkout (its python/, on the same database: the schema must be
this one's) is timed beside this one's, in the same rounds, the order rotating."""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

from cancel import BlockingHttp
from harness import ROOT, Cluster, log, pct, proc_cpu, rotated, start_broker, stop_on_sigterm

SECRET = "bench-secret-for-queen-timers-hs256-0123456789"
SERIAL = itertools.count()  # the jti of the tokens that are new at every request
TARGET = 1.5


def token(key, alg: str, pad: int = 0, jti: int | None = None) -> str:
    body = {"sub": "bench", "tenant": "acme", "role": "read-write", "exp": int(time.time()) + 3600}
    if pad:
        body["pad"] = "p" * pad
    if jti is not None:
        body["jti"] = str(jti)
    return jwt.encode(body, key, algorithm=alg)


def cases(kind: str, n: int) -> tuple[dict, dict[str, tuple[str | Callable[[], list[str]], bool]]]:
    """The broker's environment for `kind` and its credentials: name -> (token, served); for
    the credential that is new at every request, a function making n + 1 tokens never sent
    before (a block's, made before its clock starts)."""
    if kind == "secret":
        env, key, other, alg = {"QUEEN_JWT_SECRET": SECRET}, SECRET, "x" * 40, "HS256"
    else:
        make = {"rsa": lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048),
                "ed25519": ed25519.Ed25519PrivateKey.generate}[kind]
        key, other, alg = make(), make(), {"rsa": "RS256", "ed25519": "EdDSA"}[kind]
        env = {"QUEEN_JWT_PUBLIC_KEY": key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()}
    bad = "another secret" if kind == "secret" else "another key"
    return env, {"valid": (token(key, alg), True), "valid 7.5 KB": (token(key, alg, 5500), True),
                 bad: (token(other, alg), False), f"{bad} 7.5 KB": (token(other, alg, 5500), False),
                 f"{bad} 13 KB": (token(other, alg, 9700), False),
                 f"{bad}, new each time": (lambda: [token(other, alg, jti=next(SERIAL)) for _ in range(n + 1)],
                                           False)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--n", type=int, default=2000, help="requests per credential and round")
    ap.add_argument("--key", choices=("secret", "rsa", "ed25519"), default="secret",
                    help="QUEEN_JWT_SECRET (HS256), or QUEEN_JWT_PUBLIC_KEY of a new RSA 2048 / Ed25519 key")
    ap.add_argument("--compare", type=Path, help="another checkout whose broker is timed beside this one's")
    args = ap.parse_args()
    stop_on_sigterm()
    env, creds = cases(args.key, args.n)
    log(f"== jwt_cost: {args.key} ({', '.join(env)}), {args.rounds} rounds of {args.n} requests a credential ==")
    cluster = Cluster()
    cluster.setup()
    brokers = {}
    socks: dict[str, BlockingHttp] = {}
    try:
        url = cluster.create_db("bench")
        trees = {"this": ROOT, **({"compare": args.compare.resolve()} if args.compare else {})}
        for side, tree in trees.items():
            brokers[side] = start_broker(url, name=f"jwt-{side}", PYTHONPATH=str(tree / "python"),
                                         QUEEN_AUTH="jwt", **env)
        cpu: dict[tuple[str, str], list[float]] = {(side, name): [] for side in trees for name in creds}
        for r in range(args.rounds):
            for side, name in rotated(list(cpu), r):
                tok, served = creds[name]
                lat, codes = [], {}
                pid = brokers[side].proc.pid
                # a connection of its own a block, served once before the clock: the broker closes
                # a keep-alive connection idle for 5 s, as long as the other blocks may take
                if side in socks:
                    socks.pop(side).close()
                socks[side] = BlockingHttp("127.0.0.1", brokers[side].port)
                toks = tok() if callable(tok) else [tok]
                heads = [b"Authorization: Bearer %s\r\n" % t.encode() for t in toks]
                if len(heads) == 1:  # the same credential each time: one header, encoded once
                    heads *= args.n + 1
                socks[side].request("DELETE", "/api/v1/timers/q/k", heads[0])
                before = proc_cpu(pid)
                for i in range(args.n):
                    t0 = time.perf_counter()
                    code, _ = socks[side].request("DELETE", "/api/v1/timers/q/k", heads[i + 1])
                    lat.append(time.perf_counter() - t0)
                    codes[code] = codes.get(code, 0) + 1
                us = (proc_cpu(pid) - before) / args.n * 1e6
                cpu[side, name].append(us)
                if side == "this" and codes != {200 if served else 401: args.n}:
                    raise RuntimeError(f"{name}: answers {codes}")
                log(f"  round {r + 1} {side:7s} {name:28s} {len(toks[0]):6,d} bytes: broker CPU {us:5.0f} us a "
                    f"request, p50 {pct(lat, 50) * 1000:.3f} ms, {codes}")
        med = {key: statistics.median(v) for key, v in cpu.items()}
        log(f"\n== medians of {args.rounds} rounds (broker CPU a request; /proc's clock tick is "
            f"{1e6 / args.n * 0.01:.0f} us over {args.n} requests) ==")
        ok = True
        for side in trees:
            log(f"  {side} ({trees[side]}):")
            for name in creds:
                ratio = med[side, name] / med[side, "valid"]
                verdict = ""
                if name != "valid" and side == "this":
                    met = ratio <= TARGET
                    ok &= met
                    verdict = f" (target <= {TARGET}) {'met' if met else 'MISSED'}"
                log(f"    {name:28s} {med[side, name]:5.0f} us, {ratio:.2f}x its valid token's request{verdict}")
        return 0 if ok else 1
    finally:
        for s in socks.values():
            s.close()
        for b in brokers.values():
            b.stop()
        cluster.destroy()


if __name__ == "__main__":
    sys.exit(main())
