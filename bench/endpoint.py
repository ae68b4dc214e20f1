"""`agentkiln endpoint` under load: requests and tokens per second at 1, 4 and 16 concurrent clients.

The endpoint runs as users run it (`agentkiln endpoint --model <policy>`, its own process, torch's
threads); each client is an agent harness in this process playing whole episodes of the test panel
(data/tasks/test, every family) through the real `openai` client: the environment's text as messages,
its valid actions as the `admissible` extension, greedy replies. Every concurrency level plays the
same `--episodes` tasks, so their success must agree (greedy decoding does not depend on batching):
a check, written beside the throughput.

Writes bench/results/endpoint.json: per level, requests/s, completion tokens/s (reply tokens decoded),
prompt tokens/s (tokens the server prefilled), request latency (mean, p50, p95) and the episodes'
success; which model and tasks were played, the machine, the server's peak resident memory and how
long it took to end on SIGTERM.

    python bench/endpoint.py                        # after `dvc repro` (models/rl, data/tasks)
    python bench/endpoint.py --model models/sft --episodes 32 --levels 1 4 16
    python bench/endpoint.py --model /elsewhere/models/rl/main --tasks /elsewhere/data/tasks
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

from agentkiln import paths
from agentkiln.config import load_params
from agentkiln.envs import make
from agentkiln.panels import load_panel
from agentkiln.servers import free_port


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def episode(client, task, tasks_dir) -> dict:
    """One whole episode as a harness plays it; its requests, tokens, latencies and outcome."""
    env = make(task, tasks_dir)
    obs = env.reset()
    messages = [{"role": "user", "content": "\n".join(x for x in (env.goal, obs.text) if x)}]
    tools = env.tool_specs() if env.free_form else None
    out = {"requests": 0, "completion_tokens": 0, "prompt_tokens": 0, "latencies": [], "won": False}
    while True:
        start = time.perf_counter()
        try:
            r = client.chat.completions.create(model="policy", messages=messages, temperature=0, tools=tools,
                                               max_tokens=env.max_reply_tokens,
                                               extra_body={"admissible": obs.admissible} if obs.admissible else {})
        except openai.BadRequestError:  # the episode outgrew the context window
            return out
        out["latencies"].append(time.perf_counter() - start)
        out["requests"] += 1
        out["completion_tokens"] += r.usage.completion_tokens
        out["prompt_tokens"] += r.usage.prompt_tokens
        msg = r.choices[0].message
        if msg.tool_calls:
            call = msg.tool_calls[0]
            action = f"{call.function.name}[{next(iter(json.loads(call.function.arguments).values()))}]"
        else:
            action = msg.content or ""
        messages.append({"role": "assistant", "content": msg.content, "tool_calls": msg.tool_calls} if msg.tool_calls
                        else {"role": "assistant", "content": msg.content})
        res = env.step(action)
        if res.done:
            out["won"] = bool(res.info["won"])
            return out
        obs = res.observation
        messages.append({"role": "user", "content": obs.text})


def level(url: str, tasks, tasks_dir, clients: int) -> dict:
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        runs = list(pool.map(lambda t: episode(client, t, tasks_dir), tasks))
    wall = time.perf_counter() - start
    n = sum(r["requests"] for r in runs)
    latencies = sorted(x for r in runs for x in r["latencies"])
    cuts = statistics.quantiles(latencies, n=20, method="inclusive") if len(latencies) > 1 else latencies * 19
    return {"clients": clients, "episodes": len(runs), "requests": n, "wall_s": round(wall, 2),
            "requests_per_s": round(n / wall, 2),
            "completion_tokens_per_s": round(sum(r["completion_tokens"] for r in runs) / wall, 1),
            "prompt_tokens_per_s": round(sum(r["prompt_tokens"] for r in runs) / wall, 1),
            "mean_latency_s": round(sum(latencies) / max(n, 1), 4), "p50_latency_s": round(cuts[9], 4),
            "p95_latency_s": round(cuts[18], 4),
            "success": sum(r["won"] for r in runs) / len(runs), "won": [r["won"] for r in runs]}


def machine() -> dict:
    """What the figures were measured on."""
    import torch

    from agentkiln.policy.device import cpu_name

    return {"cpu": cpu_name(), "cores": os.cpu_count(),
            "load_avg_1m_at_start": round(os.getloadavg()[0], 2), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads_server": "torch default (the cores)"}


def _shown(path: Path) -> str:
    """A path as the results file keeps it: relative to the working directory when inside it (a committed
    result names no one's machine)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", default=None, help="a policy directory (default: the pipeline's rl model, else models/sft)")
    ap.add_argument("--tasks", default=str(paths.TASKS), help="the tasks directory whose test panel is played")
    ap.add_argument("--note", default=None, help="where the model and tasks came from, written with the results")
    ap.add_argument("--episodes", type=int, default=32, help="test-panel tasks played at every level")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16], help="concurrent clients")
    ap.add_argument("--out", default="bench/results/endpoint.json")
    args = ap.parse_args()
    if args.model is None:
        rl = paths.model_dirs(load_params())["rl"]
        model = rl if rl.is_dir() else paths.SFT_MODEL
    else:
        model = Path(args.model)
    if not model.is_dir():
        sys.exit(f"bench/endpoint.py: no policy at {args.model or 'models/rl or models/sft'}: run `dvc repro` first")
    tasks_dir = Path(args.tasks)
    tasks = load_panel(tasks_dir, "test")[: args.episodes]
    at = machine()
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="bench-endpoint-")) / "endpoint.log"
    with open(log, "w") as f:  # a file, not a pipe nobody reads: the server never blocks on its output
        server = subprocess.Popen([str(Path(sys.executable).parent / "agentkiln"), "endpoint", "--model", str(model),
                                   "--port", str(port)], stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while not healthy(port):
            if server.poll() is not None or time.time() > deadline:
                sys.exit(f"the endpoint did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        url = f"http://127.0.0.1:{port}/v1"
        version = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()["model_version"]
        level(url, tasks[:2], tasks_dir, 1)  # warm-up: first requests pay for lazy initialisation
        results = []
        for clients in args.levels:
            results.append(level(url, tasks, tasks_dir, clients))
            r = results[-1]
            print(f"{clients:>3} clients: {r['requests_per_s']:7.2f} requests/s, {r['completion_tokens_per_s']:8.1f} "
                  f"reply tokens/s, {r['prompt_tokens_per_s']:9.1f} prompt tokens/s, latency mean "
                  f"{r['mean_latency_s']:.3f} s p50 {r['p50_latency_s']:.3f} s p95 {r['p95_latency_s']:.3f} s, "
                  f"success {r['success']:.3f}", flush=True)
        peak_rss = _peak_rss(server.pid)
    finally:
        stopping = time.monotonic()
        server.send_signal(signal.SIGTERM)
        server.wait(60)
        stop_s = time.monotonic() - stopping
    same = all(r["won"] == results[0]["won"] for r in results)
    report = {"bench": "endpoint", "model": _shown(model), "model_version": version, "model_config": _model_meta(model),
              "tasks": _shown(tasks_dir), "note": args.note,
              "panel": "test", "episodes": len(tasks), "machine": at,
              "levels": [{k: v for k, v in r.items() if k != "won"} for r in results],
              "same_outcomes_at_every_level": same, "server_peak_rss_mib": peak_rss,
              "server_sigterm_to_exit_s": round(stop_s, 2)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}" + ("" if same else "  (WARNING: outcomes differ between levels)"))


def _peak_rss(pid: int) -> float | None:
    """The server process's peak resident memory (MiB; Linux /proc)."""
    status = Path(f"/proc/{pid}/status")
    if not status.is_file():
        return None
    kb = next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith("VmHWM:"))
    return round(kb / 1024, 1)


def _model_meta(model: Path) -> dict:
    """Enough to tell which policy was served: its size (the version /health names is its digest)."""
    config = json.loads((model / "config.json").read_text())
    return {k: config.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")}


if __name__ == "__main__":
    main()
