"""What the endpoint's tests share: an endpoint served in this process (`Served`) or as the real command
in its own process (`Command`), and an agent harness playing a whole episode through the openai client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from agentkiln.servers import free_port

SCRIPT = Path(sys.executable).parent / "agentkiln"


class Served:
    """An endpoint (app + uvicorn) on a free loopback port in this process, stopped on exit."""

    def __init__(self, spec: str, record: Path | None = None, poll: float = 10.0, limits=None, log=None,
                 generators=None):
        import uvicorn

        from agentkiln.serving.app import create_app
        from agentkiln.serving.limits import Limits
        from agentkiln.serving.recorder import Recorder
        from agentkiln.serving.source import ModelSource
        from agentkiln.serving.worker import Worker

        limits = limits or Limits()
        self.logged: list[str] = []
        log = log or self.logged.append
        self.source = ModelSource(spec, poll=poll, log=lambda *_: None)
        self.worker = Worker(self.source, Recorder(record, limits.record_bytes, log=log) if record else None,
                             generators=generators, limits=limits, log=log)
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.worker, log=log), host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        self.source.follow()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "the endpoint did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)
        self.source.stop()
        self.worker.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=60)


class Command:
    """`agentkiln endpoint` as a user runs it, in its own process (its output in a file: nobody has to read
    a pipe for it to go on), up once /health answers; SIGKILLed on exit if still running."""

    def __init__(self, model: Path, cwd: Path, *options: str):
        self.port, self.log = free_port(), cwd / f"endpoint-{time.time_ns()}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([str(SCRIPT), "endpoint", "--model", str(model), "--port", str(self.port),
                                          "--threads", "1", *options], cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while not self.healthy():
            assert self.proc.poll() is None and time.time() < deadline, f"the endpoint did not start:\n{self.output()}"
            time.sleep(0.2)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.base}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text()

    def rss(self) -> tuple[int, int]:
        """(resident, peak resident) bytes of the server process (Linux /proc)."""
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines())
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024

    def stop(self) -> float:
        """SIGTERM; the seconds it took to end (AssertionError past 30 s)."""
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)
        return time.monotonic() - start

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def harness_episode(client, task, tasks_dir, max_turns=None):
    """One whole episode as an agent harness plays it: the environment's text as user / tool messages,
    its valid actions as the `admissible` extension, the reply's tool call or content as the action."""
    import openai

    from agentkiln.envs import make

    env = make(task, tasks_dir, max_turns=max_turns)
    obs = env.reset()
    tools = env.tool_specs() if env.free_form else None
    messages = [{"role": "user", "content": "\n".join(x for x in (env.goal, obs.text) if x)}]
    actions, served = [], []
    while True:
        extra = {"admissible": obs.admissible} if obs.admissible else {}
        try:
            r = client.chat.completions.create(model="policy", messages=messages, temperature=0, tools=tools,
                                               max_tokens=env.max_reply_tokens, extra_body=extra,
                                               metadata={"task_id": task.task_id, "family": task.family})
        except openai.BadRequestError as e:  # the conversation outgrew the context: the episode is cut
            assert "context" in str(e)
            break
        msg = r.choices[0].message
        served.append(r.model_extra["prompt_token_ids"] + r.choices[0].model_extra["token_ids"])
        if msg.tool_calls:
            call = msg.tool_calls[0]
            action = f"{call.function.name}[{next(iter(json.loads(call.function.arguments).values()))}]"
            messages.append(msg.model_dump(exclude_none=True))
            role = {"role": "tool", "tool_call_id": call.id}
        else:
            action = msg.content
            messages.append({"role": "assistant", "content": msg.content})
            role = {"role": "user"}
        actions.append(action)
        res = env.step(action)
        if res.done:
            return {"actions": actions, "won": bool(res.info["won"]), "episode": r.model_extra["agentkiln"]["episode_id"],
                    "served": served}
        obs = res.observation
        messages.append(role | {"content": obs.text})
    return {"actions": actions, "won": False, "episode": None, "served": served}
