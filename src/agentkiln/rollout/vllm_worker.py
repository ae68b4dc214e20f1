"""The vLLM engine process of `compute.rollout.backend: vllm` (client: agentkiln.rollout.vllm_backend).

Run BY FILE PATH with the python of vLLM's own environment (scripts/install_vllm.sh):

    <vllm env>/bin/python vllm_worker.py CMD_FD REPLY_FD

It imports only the standard library, vllm and torch (never agentkiln: that lives in another
environment). Protocol: one JSON object per line; the client writes requests to CMD_FD, the worker
answers each on REPLY_FD with {"ok": true, ...} or {"ok": false, "error": traceback}. stdout and
stderr are vLLM's logs (the client sends them to a file). The first request is the engine's config;
the worker answers {"ok": true, "op": "ready"} once the engine is up. Then:

    {"op": "generate", "reqs": [...], "lora": null | {"name", "id", "path"}}  -> {"out": [...]}
        req: {"ids": prompt ids, "max_tokens", "temperature" (0: greedy), "seed", "stop": [ids],
              "allowed": [ids] | null (allowed_token_ids), "score": [ids] | null (logprob_token_ids),
              "top": k (without "score": the k most likely)}
        out: {"ids": generated ids, "lp": log-prob of each,
              "score": [[log-probs of the sampled token and the `score` ids or the `top` k, at each token]] | null}
    {"op": "reload_weights", "path": model dir}   full weights (its *.safetensors), reloaded in place (no restart)
    {"op": "exit"}

Log-probs are vLLM's "processed" ones: of the distribution sampled from, after allowed_token_ids
masking and temperature scaling (greedy requests: masking only, no temperature).

The worker exits on "exit", on end-of-file of CMD_FD (the client died), and when its parent process
is gone (a watchdog thread: the client may be SIGKILLed while the engine is busy; the worker then also
removes the client's rollout directory, named by "cleanup" in the init request).
"""

import json
import os
import sys
import threading
import time
import traceback

# before vllm is imported:
# - the engine core in this process (no extra engine process to orphan)
# - no torch.compile: vLLM compiles a small logprob-rank helper with inductor on first use (15 s on CPU)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


_ORPHANED_DIRS: list[str] = []  # the client's rollout directory: removed if the client dies without close()


def _orphaned(code: int) -> None:
    """The client is gone without `exit`: remove its rollout directory and leave."""
    import shutil

    for d in _ORPHANED_DIRS:
        shutil.rmtree(d, ignore_errors=True)
    os._exit(code)


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:  # the trainer is gone: never outlive it
            _orphaned(3)
        time.sleep(1.0)


def _repack_tied_head(model) -> None:
    """After an in-place reload, rebuild the output head's kernel weights from the (tied) embedding.
    vLLM 0.32 reloads only layers with weights in the checkpoint; a tied lm_head has none, so on CPU its
    packed GEMM copy (made by process_weights_after_loading) would keep the OLD embedding: the logits
    then disagree with the trainer's model whenever training moved the embeddings (measured here)."""
    head = getattr(model, "lm_head", None)
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is not None and emb is not None and getattr(head, "weight", None) is getattr(emb, "weight", False):
        head.quant_method.process_weights_after_loading(head)


def _engine(cfg: dict):
    from vllm import LLM

    kw = {k: cfg[k] for k in ("model", "dtype", "max_model_len", "gpu_memory_utilization", "tensor_parallel_size",
                              "enforce_eager", "max_num_seqs", "seed", "max_logprobs")}
    kw.update(skip_tokenizer_init=True,  # token ids in and out: vLLM never sees text
              enable_prefix_caching=True,  # constrained decoding re-sends the prompt every token
              logprobs_mode="processed_logprobs",  # of the masked, temperature-scaled distribution sampled from
              generation_config="vllm")  # ignore the model's generation_config.json: the client sets every knob
    if cfg.get("lora_rank"):
        kw.update(enable_lora=True, max_lora_rank=cfg["lora_rank"], max_loras=1, max_cpu_loras=2)
    return LLM(**kw)


def _generate(llm, reqs: list[dict], lora: dict | None) -> list[dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    prompts, params = [], []
    for r in reqs:
        score, top = r.get("score") or None, r.get("top", 0)
        params.append(SamplingParams(
            n=1, max_tokens=r["max_tokens"], temperature=r["temperature"],
            seed=r["seed"] if r["temperature"] > 0 else None,
            stop_token_ids=r["stop"], ignore_eos=True,  # only the chat's end-of-turn ids end a reply
            detokenize=False, allowed_token_ids=r.get("allowed"),  # [] is refused by vLLM, never unconstrained
            logprobs=len(score) if score else top, logprob_token_ids=score))
        prompts.append(TokensPrompt(prompt_token_ids=r["ids"]))
    lreq = LoRARequest(lora["name"], lora["id"], lora["path"]) if lora else None
    # vLLM 0.32 returns, for a whole scheduled batch, either logprob_token_ids or top-k log-probs: a top-k
    # request batched with logprob_token_ids requests gets only padding back. So they go in separate calls.
    top = {i for i, r in enumerate(reqs) if r.get("top") and not r.get("score")}
    rest = [i for i in range(len(reqs)) if i not in top]
    outs = [None] * len(reqs)
    for group in (rest, sorted(top)):
        if group:
            got = llm.generate([prompts[i] for i in group], [params[i] for i in group], use_tqdm=False,
                               lora_request=lreq)
            for i, o in zip(group, got):
                outs[i] = o
    res = []
    for r, o in zip(reqs, outs):
        c = o.outputs[0]
        ids = list(c.token_ids)
        lps = [d[t].logprob for t, d in zip(ids, c.logprobs)]
        # every token vLLM returned a log-prob for: the sampled one, and the `score` ids or the `top` most likely
        res.append({"ids": ids, "lp": lps,
                    "score": [[x.logprob for x in d.values()] for d in c.logprobs] if r.get("score") or r.get("top") else None})
    return res


def main() -> None:
    cmd_fd, reply_fd = int(sys.argv[1]), int(sys.argv[2])
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    cmds = os.fdopen(cmd_fd, "r", encoding="utf-8")
    replies = os.fdopen(reply_fd, "w", encoding="utf-8")

    def answer(obj: dict) -> None:
        replies.write(json.dumps(obj, allow_nan=True) + "\n")
        replies.flush()

    llm = None
    for line in cmds:  # end of file: the client closed the pipe or died
        try:
            msg = json.loads(line)
            op = msg["op"]
            if op == "init":
                t0 = time.time()
                if msg.get("cleanup"):
                    _ORPHANED_DIRS.append(msg["cleanup"])
                import vllm

                llm = _engine(msg["config"])
                answer({"ok": True, "op": "ready", "vllm": vllm.__version__, "startup_s": time.time() - t0})
            elif op == "generate":
                answer({"ok": True, "out": _generate(llm, msg["reqs"], msg.get("lora"))})
            elif op == "reload_weights":
                # vLLM's in-place reload from the model directory (its CPU kernels repack weights after loading,
                # so a plain model.load_weights cannot write into them); every TP worker reloads its shard
                llm.collective_rpc("reload_weights", kwargs={"weights_path": msg["path"]})
                from vllm.platforms import current_platform

                if current_platform.is_cpu():  # GPU kernels read the weight itself: nothing to rebuild
                    llm.apply_model(_repack_tied_head)
                llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
                answer({"ok": True})
            elif op == "exit":
                answer({"ok": True})
                os._exit(0)  # skip vLLM's atexit teardown: nothing to flush, and it can hang on a dead client
            else:
                answer({"ok": False, "error": f"unknown op {op!r}"})
        except BaseException:  # noqa: BLE001  (report it to the client, which raises)
            answer({"ok": False, "error": traceback.format_exc()})
            if llm is None:
                os._exit(1)
    _orphaned(0)  # end of file without `exit`: the client died


if __name__ == "__main__":  # vLLM may spawn helpers that re-import __main__
    main()
