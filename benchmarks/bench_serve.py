"""Model service latency and throughput with RFC 9530 digest checks on vs off.

Two uvicorn server processes run side by side, serving the same tiny model:
"on" requires a request Content-Digest (sha-256, checked as the body streams)
and adds one to every response; "off" ignores request digests and adds none.
The client (this process, httpx, keep-alive) computes the request digest per
request for "on", as a real client does, and verifies the response digest.
Rounds alternate between the two servers so that background load hits both.

Target (issue 8): digest verification adds under 5% at 1 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import table, write_results
from torchverity.serve import ContentDigestMiddleware, format_digest, verify_digest

KiB, MiB = 1 << 10, 1 << 20


class SumNet(torch.nn.Module):
    """Cheap on purpose: the benchmark measures the transport, not the model."""

    input_spec = ("x:float32:-1",)

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scale).sum(0, keepdim=True)


def child(mode: str, port: int) -> None:
    import uvicorn

    from torchverity.serve import create_app

    on = mode == "on"
    app = create_app(SumNet(), digest_policy="require" if on else "ignore",
                     response_digest="sha-256" if on else None, recheck_interval=None,
                     max_body=4 * MiB)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error")


def body_of_size(target: int) -> bytes:
    """A /predict request of about ``target`` bytes (floats printed to 8 digits)."""
    count = max(1, (target - 80) // 11)
    data = ",".join(f"{(i % 997) / 997:.8f}" for i in range(count))
    return (f'{{"inputs":[{{"name":"x","datatype":"FP32","shape":[{count}],'
            f'"data":[{data}]}}]}}').encode()


def one_request(client: httpx.Client, body: bytes, on: bool) -> float:
    start = time.perf_counter()
    headers = {"Content-Type": "application/json"}
    if on:
        headers["Content-Digest"] = format_digest("sha-256", body)
    r = client.post("/predict", content=body, headers=headers)
    if r.status_code != 200:
        raise SystemExit(f"benchmark request failed: {r.status_code} {r.text[:200]}")
    if on:
        verify_digest(r.headers["content-digest"], r.content)
    return time.perf_counter() - start


def latencies(urls: dict[str, str], body: bytes, n: int) -> dict[str, list[float]]:
    """Sequential requests, alternating between the servers request by request."""
    out: dict[str, list[float]] = {"on": [], "off": []}
    with httpx.Client(base_url=urls["on"], timeout=60) as on, \
            httpx.Client(base_url=urls["off"], timeout=60) as off:
        clients = {"on": on, "off": off}
        for i in range(n + 1):
            for mode in ("on", "off") if i % 2 else ("off", "on"):
                t = one_request(clients[mode], body, mode == "on")
                if i:  # the first round only warms the connections
                    out[mode].append(t)
    return out


def throughput(url: str, body: bytes, on: bool, n: int, concurrency: int) -> float:
    def work(count: int) -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            for _ in range(count):
                one_request(client, body, on)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(work, [n // concurrency] * concurrency))
    return (n // concurrency) * concurrency / (time.perf_counter() - start)


def middleware_cost_ms(size: int, on: bool, repeat: int = 20) -> float:
    """Server-side cost of the middleware alone (in process, no network), per request."""
    import asyncio

    body = os.urandom(size)
    chunks = [body[i:i + 64 * KiB] for i in range(0, size, 64 * KiB)]
    answer = b'{"outputs": []}'

    async def app(scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def]
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": answer})

    wrapped = ContentDigestMiddleware(app, policy="require" if on else "ignore",
                                      max_body=4 * MiB,
                                      response_algorithm="sha-256" if on else None)
    headers = [(b"content-length", str(size).encode())]
    if on:
        headers.append((b"content-digest", format_digest("sha-256", body).encode()))
    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}

    async def once() -> None:
        queue = list(chunks)

        async def receive() -> dict:
            chunk = queue.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(queue)}

        async def send(message: dict) -> None:
            pass

        await wrapped(scope, receive, send)

    async def run() -> float:
        start = time.perf_counter()
        for _ in range(repeat):
            await once()
        return (time.perf_counter() - start) / repeat

    return min(asyncio.run(run()) for _ in range(3)) * 1000


def load_test(url: str, total: int, concurrency: int) -> tuple[list[float], int]:
    """``total`` small verified requests from ``concurrency`` threads: latencies and errors."""
    body = body_of_size(KiB)

    def work(count: int) -> tuple[list[float], int]:
        times, errors = [], 0
        with httpx.Client(base_url=url, timeout=60) as client:
            for _ in range(count):
                try:
                    times.append(one_request(client, body, True))
                except (SystemExit, httpx.HTTPError, ValueError):
                    errors += 1
        return times, errors

    with ThreadPoolExecutor(concurrency) as pool:
        parts = list(pool.map(work, [total // concurrency] * concurrency))
    return [t for times, _ in parts for t in times], sum(e for _, e in parts)


def start_servers() -> tuple[dict[str, str], list[subprocess.Popen[bytes]]]:
    urls, procs = {}, []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for mode in ("on", "off"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs.append(subprocess.Popen([sys.executable, __file__, "--child", mode, str(port)],
                                      env=env))
        urls[mode] = f"http://127.0.0.1:{port}"
    for url in urls.values():
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"server at {url} did not start")
            time.sleep(0.1)
    return urls, procs


def measure(urls: dict[str, str], size: int, rounds: int, n_latency: int,
            n: int) -> dict[str, dict[str, float]]:
    body = body_of_size(size)
    lat = latencies(urls, body, n_latency)
    rps: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(rounds):
        for mode in ("on", "off") if i % 2 else ("off", "on"):
            rps[mode].append(throughput(urls[mode], body, mode == "on", n, 4))
    return {
        mode: {"p50": statistics.median(lat[mode]) * 1000,
               "p99": statistics.quantiles(lat[mode], n=100)[98] * 1000,
               "rps": statistics.median(rps[mode]), "bytes": len(body),
               "middleware": middleware_cost_ms(len(body), mode == "on")}
        for mode in ("on", "off")
    }


def hash_cost_ms(size: int) -> float:
    data = os.urandom(size)
    start = time.perf_counter()
    for _ in range(20):
        format_digest("sha-256", data)
    return (time.perf_counter() - start) / 20 * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    urls, procs = start_servers()
    try:
        # (throughput rounds, latency pairs, requests per throughput block)
        plan = {KiB: (4, 200, 100) if args.quick else (4, 1000, 300),
                MiB: (4, 40, 8) if args.quick else (4, 300, 24)}
        results = {size: measure(urls, size, *plan[size]) for size in plan}
        total = 500 if args.quick else 2000
        load, errors = load_test(urls["on"], total, 8)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
    rows, summary = [], {}
    for size, res in results.items():
        label = "1 KiB" if size == KiB else "1 MiB"
        on, off = res["on"], res["off"]
        for mode in ("off", "on"):
            r = res[mode]
            rows.append((label, f"digests {mode}", r["bytes"], f"{r['p50']:.2f}",
                         f"{r['p99']:.2f}", f"{r['rps']:.0f}", f"{r['middleware']:.3f}"))
        summary[label] = {"p50_overhead": on["p50"] / off["p50"] - 1,
                          "throughput_cost": 1 - on["rps"] / off["rps"],
                          "server_side_share": (on["middleware"] - off["middleware"]) / off["p50"]}
    body = ("Same tiny model behind both servers; \"on\" = `digest_policy=\"require\"` plus a "
            "sha-256 `Content-Digest` on every response, client digest computed and response "
            "digest verified per request; \"off\" = no digests at all. Latency: one client, "
            "sequential keep-alive requests alternating between the servers. Throughput: 4 client "
            "threads, alternating blocks. Middleware: the ASGI middleware alone on the same "
            "body in 64 KiB chunks, no network, best of 3.\n\n")
    body += table(("body", "mode", "request bytes", "p50 ms", "p99 ms", "requests/s",
                   "middleware ms (in process)"), rows)
    body += "\n"
    for label, s in summary.items():
        body += (f"- {label}: end to end, digests change median latency by "
                 f"{s['p50_overhead']:+.1%} and throughput by {-s['throughput_cost']:+.1%}; the "
                 f"server-side digest work alone is {s['server_side_share']:.1%} of a request's "
                 "median time.\n")
    body += (f"- For scale: one sha-256 over 1 MiB takes {hash_cost_ms(MiB):.2f} ms here; the "
             "server hashes the request once (as it streams) and the response once, the client "
             "does the same, against a request that spends most of its time in JSON parsing "
             "and tensor conversion.\n")
    share = summary["1 MiB"]["server_side_share"]
    body += (f"\nTarget: digest verification adds under 5% at 1 MiB. Server side it adds "
             f"{share:.1%} here ({'met' if share < 0.05 else 'not met'}): one SHA-256 pass over "
             "the body, at hashlib's speed, against a request whose JSON parsing and tensor "
             "conversion take the rest. End to end the client's own hashing of the request "
             "comes on top. The machine is 2 cores shared with other work, so end-to-end "
             "differences of several percent are within noise from run to run; latency "
             "requests alternate between the two servers to spread that noise evenly.\n")
    q = statistics.quantiles(load, n=100)
    body += (f"\n## Load: {total} requests of 1 KiB at concurrency 8, digests on\n\n"
             f"{len(load)} answers verified (request and response digests), {errors} errors; "
             f"latency p50 {q[49] * 1000:.1f} ms, p99 {q[98] * 1000:.1f} ms (one inference "
             "thread in the server, so requests queue for the model).\n")
    cmd = "python benchmarks/bench_serve.py" + (" --quick" if args.quick else "")
    print(write_results("serve", "Serving: digest checks on vs off", cmd, body).read_text())
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
