"""Requests/s and latency of the controller's API under a loopback load generator.

The controller runs in its own process (uvicorn, SQLite in WAL mode in a temp folder, Ray
replaced by a no-op job server: this measures the API and the store, not Ray). The load
generator (asyncio, a pool of HTTP/1.1 keep-alive connections written by hand so that the
client costs little of the machine's two cores, in this process) runs each scenario for a
bounded time and prints one table:

    GET /api/jobs @ 200/s   open loop at a fixed rate; latency from each request's
                            scheduled start (no coordinated omission)
      +20w/s                the same while 20 steps/s are ingested (4 running jobs at
                            5 steps/s): every write invalidates the cached list page
    GET /api/jobs max       closed loop, --concurrency requests in flight
    ingest 100 steps/POST   what a driver's ControllerSink sends, closed loop
    ingest 1 step/POST      unbatched, the worst case

Targets (issue #5): p99 under 50 ms at 200 requests/s, ingestion of 1,000 rows/s.

    .venv/bin/python benchmarks/controller_load.py [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.controller.ray_head import free_port  # noqa: E402

NUM_JOBS = 200
METRIC_NAMES = ["pg_loss", *(f"pg_loss/{m}" for m in ("sample_mean", "token_mean",
                "prompt_mean", "constant")), "kl", "entropy", "clip_fraction", "grad_norm",
                "lr", "padding_fraction", "reward/mean", "reward/std", "response_length/mean",
                "perf/tokens_per_s", "perf/step_time_s", "mismatch/log_prob_abs_diff",
                *(f"rollout/x{i}" for i in range(15))]


def serve(port: int, data_dir: str) -> None:
    """The server process: the real app, a job server that accepts and forgets."""
    import uvicorn

    from services.controller.app import create_app
    from services.controller.ray_jobs import RayJobInfo
    from services.controller.settings import Settings

    class NullBackend:
        address = "null://"

        def submit(self, submission_id, entrypoint, env_vars, metadata):
            return submission_id

        def info(self, submission_id: str) -> RayJobInfo:
            return RayJobInfo("running")

        def stop(self, submission_id: str) -> bool:
            return True

        def logs(self, submission_id: str) -> str:
            return ""

        async def follow(self, submission_id: str):
            yield ""

        def find_submission(self, ray_job_id: str, driver_pid: int) -> None:
            return None

    settings = Settings(data_dir=Path(data_dir), port=port)  # 2 jobs "run", the rest queue
    uvicorn.run(create_app(settings, backend=NullBackend()), host="127.0.0.1", port=port,
                log_level="warning", access_log=False)


class Response:
    def __init__(self, status_code: int, body: bytes) -> None:
        self.status_code, self.body = status_code, body

    def json(self) -> dict:
        return json.loads(self.body)


class RawClient:
    """HTTP/1.1 over asyncio streams, ``size`` keep-alive connections to 127.0.0.1."""

    def __init__(self, port: int, size: int) -> None:
        self.port, self.size = port, size
        self.pool: asyncio.Queue = asyncio.Queue()

    async def __aenter__(self) -> RawClient:
        for _ in range(self.size):
            self.pool.put_nowait(await asyncio.open_connection("127.0.0.1", self.port))
        return self

    async def __aexit__(self, *exc: object) -> None:
        while not self.pool.empty():
            _, writer = self.pool.get_nowait()
            writer.close()

    async def request(self, method: str, path: str, body: object = None) -> Response:
        data = json.dumps(body).encode() if body is not None else b""
        head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Length: {len(data)}\r\n")
        head += "Content-Type: application/json\r\n\r\n" if data else "\r\n"
        reader, writer = await self.pool.get()
        try:
            writer.write(head.encode() + data)
            header = await reader.readuntil(b"\r\n\r\n")
            lines = header.decode("latin-1").split("\r\n")
            length = next(int(line.split(":")[1]) for line in lines
                          if line.lower().startswith("content-length:"))
            return Response(int(lines[0].split()[1]), await reader.readexactly(length))
        finally:
            self.pool.put_nowait((reader, writer))

    async def get(self, path: str) -> Response:
        return await self.request("GET", path)

    async def post(self, path: str, json: object) -> Response:
        return await self.request("POST", path, json)


def rows(start: int, count: int) -> list[dict]:
    return [{"step": s, "time": time.time(),
             "metrics": {name: 0.001 * s + i for i, name in enumerate(METRIC_NAMES)}}
            for s in range(start, start + count)]


def summary(name: str, latencies: list[float], seconds: float, units: int, unit: str,
            errors: int) -> tuple:
    ms = sorted(x * 1000 for x in latencies) or [float("nan")]
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    return (name, len(latencies) / seconds, units / seconds, unit, statistics.median(ms), p99,
            errors)


async def open_loop(http: RawClient, rate: float, seconds: float, writes_per_s: float = 0.0,
                    job_ids: list[str] | None = None) -> tuple:
    """GETs at a fixed rate; optionally 1-step ingest POSTs alongside (each one changes the
    jobs table, so the list is rebuilt instead of served from the controller's cache)."""
    latencies: list[float] = []
    errors = 0
    start = time.perf_counter()

    async def one(scheduled: float) -> None:
        nonlocal errors
        response = await http.get("/api/jobs?limit=50")
        errors += response.status_code != 200
        latencies.append(time.perf_counter() - scheduled)

    async def writer() -> None:
        for n in range(int(writes_per_s * seconds)):
            await asyncio.sleep(max(0.0, start + n / writes_per_s - time.perf_counter()))
            job_id = (job_ids or [])[n % 4]
            await http.post(f"/api/jobs/{job_id}/metrics", {"rows": rows(1000 + n, 1)})

    tasks = [asyncio.create_task(writer())] if writes_per_s else []
    for i in range(int(rate * seconds)):
        scheduled = start + i / rate
        await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
        tasks.append(asyncio.create_task(one(scheduled)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    name = f"GET /api/jobs @ {rate:.0f}/s" + (f" +{writes_per_s:.0f}w/s" if writes_per_s else "")
    return summary(name, latencies, elapsed, len(latencies), "req", errors)


async def closed_loop(http: RawClient, name: str, seconds: float, concurrency: int,
                      request, units_per_request: int, unit: str) -> tuple:
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds

    async def worker(index: int) -> None:
        nonlocal errors
        n = 0
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            response = await request(index, n)
            errors += response.status_code >= 400
            latencies.append(time.perf_counter() - started)
            n += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - started
    return summary(name, latencies, elapsed, len(latencies) * units_per_request, unit, errors)


async def run(port: int, seconds: float, concurrency: int) -> list[tuple]:
    async with RawClient(port, 32) as http:
        job_ids = []
        for i in range(NUM_JOBS):
            job = (await http.post("/api/jobs", {"config": {  # room for every ingested step
                "name": f"bench-{i}", "num_steps": 10_000_000}})).json()
            job_ids.append(job["id"])
        for job_id in job_ids[:50]:
            await http.post(f"/api/jobs/{job_id}/metrics", {"rows": rows(0, 20)})
        await open_loop(http, 50, 1.0)  # warm-up
        table = [await open_loop(http, 200, seconds),
                 await open_loop(http, 200, seconds, writes_per_s=20, job_ids=job_ids)]
        table.append(await closed_loop(
            http, "GET /api/jobs max", seconds / 2, concurrency,
            lambda i, n: http.get("/api/jobs?limit=50"), 1, "req"))
        table.append(await closed_loop(
            http, "ingest 100 steps/POST", seconds, 2,
            lambda i, n: http.post(f"/api/jobs/{job_ids[100 + i]}/metrics",
                                   {"rows": rows(n * 100, 100)}), 100, "steps"))
        table.append(await closed_loop(
            http, "ingest 1 step/POST", seconds / 2, 4,
            lambda i, n: http.post(f"/api/jobs/{job_ids[110 + i]}/metrics",
                                   {"rows": rows(n, 1)}), 1, "steps"))
        return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each scenario")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--serve", nargs=2, metavar=("PORT", "DATA_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(int(args.serve[0]), args.serve[1])
        return
    with tempfile.TemporaryDirectory(prefix="tally-bench-") as data_dir:
        port = free_port()
        server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), data_dir],
                                  cwd=ROOT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    httpx.get(f"{url}/healthz", timeout=1)
                    break
                except httpx.TransportError:
                    if time.monotonic() > deadline or server.poll() is not None:
                        raise SystemExit("the controller did not start") from None
                    time.sleep(0.2)
            table = asyncio.run(run(port, args.seconds, args.concurrency))
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"{'scenario':<30} {'req/s':>8} {'units/s':>9} {'unit':<6} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'errors':>6}")
    for name, rps, ups, unit, p50, p99, errors in table:
        print(f"{name:<30} {rps:>8.1f} {ups:>9.1f} {unit:<6} {p50:>7.1f} {p99:>7.1f} "
              f"{errors:>6}")


if __name__ == "__main__":
    main()
