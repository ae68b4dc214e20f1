"""agentkiln's RL iteration on real model shapes and real hardware, beside raw Hugging Face loops.

A random-init Qwen2 model of Qwen2.5-0.5B's or -1.5B's shape (or `tiny`, for a CPU) with a byte-level
BPE tokenizer trained on the task text and Qwen2.5's chat template, built in a temporary directory:
nothing is downloaded. The model's vocabulary is padded to the real 151,936 rows while the tokenizer is
small (ids it does not know decode to nothing): the FLOPs and memory of the real shape, which is what
throughput depends on. Measured, on the device and precision asked for (`place`: bf16 is autocast over
fp32 master weights, as in the pipeline):

- rollout: `run_episodes` + `PolicyAgent` (the KV-cache engine of the RL stage) plays FrozenLake tasks
  in groups, free-form decoding of exactly `--max-reply-tokens` per turn (random weights rarely stop
  early) for `--max-turns` turns. tokens/s counts every token of every episode (prompt, observations,
  replies: what the model processed); generated tokens/s counts the replies.
- update: `trainers.rl.update` (PPO-clip, one optimizer step per pass, micro-batch accumulation) on
  the batch of those episodes (`build_batch`), with random advantages: random weights win no game, so
  GRPO's advantages would all be zero and `prepare` would drop every row. tokens/s counts every
  token of every row.
- raw HF generate: `model.generate` on `--gen-batch` x `--prompt-len` random prompts, exactly
  `--new-tokens` new tokens each (greedy), under the same autocast.
- raw HF train: `model(ids).logits` -> cross-entropy over every position -> backward, AdamW step, on
  `--train-batch` x `--train-len` tokens in micro-batches of `--micro-batch`.

MFU = FLOPs/s over the device's dense bf16 peak (a table by GPU name, or `--peak-tflops`; null on CPU):
6 N per trained token, 2 N per token of a forward-only pass (rollout, generate), N = the model's
parameters (tied embeddings once). Peak memory: torch.cuda.max_memory_allocated per phase on CUDA, the
process's peak RSS so far (ru_maxrss) on CPU. `reference` holds numbers measured on an H100.

    python bench/gpu_rl.py --shape tiny --device cpu --tasks 4 --batch 8    # a minute on a laptop CPU
    python bench/gpu_rl.py --shape 0.5b --device cuda --dtype bf16          # -> bench/results/gpu_rl_0.5b_cuda.json
    python bench/gpu_rl.py --shape 1.5b --device cuda --dtype bf16 --micro-batch 8
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing from a hub, ever
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from agentkiln.config import ComputeParams, LoRAParams, RLParams
from agentkiln.envs import make
from agentkiln.policy import lora
from agentkiln.policy.device import resolve_device
from agentkiln.policy.model import PROBE_TEXTS, Policy, place
from agentkiln.policy.prompt import AgentFormat, observation_text
from agentkiln.policy.tokenizer import check_tokenizer
from agentkiln.rollout.agents import PolicyAgent
from agentkiln.rollout.engine import run_episodes
from agentkiln.synthesis.generate import generate as synthesize_tasks
from agentkiln.trainers.batch import build_batch
from agentkiln.trainers.engine import LocalEngine
from agentkiln.trainers.rl import update

QWEN_VOCAB = 151_936
# Qwen2.5's architecture (config.json of Qwen/Qwen2.5-0.5B-Instruct and -1.5B-Instruct); `tiny` is a CPU toy
SHAPES = {
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "vocab_size": 2048},
    "0.5b": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "intermediate_size": 4864, "vocab_size": QWEN_VOCAB},
    "1.5b": {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
             "intermediate_size": 8960, "vocab_size": QWEN_VOCAB},
}
QWEN_COMMON = {"max_position_embeddings": 32768, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
               "tie_word_embeddings": True}
# dense bf16 tensor-core peak, TFLOP/s (vendor data sheets, without sparsity), by a piece of
# torch.cuda.get_device_name(); first match wins, so the more specific names come first
PEAK_BF16_TFLOPS = [
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0),
    ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0), ("A10G", 70.0),
]
REFERENCE = {  # measured on an H100 SXM, bf16, SDPA, torch 2.11, transformers 5.17
    "device": "NVIDIA H100 80GB HBM3", "dtype": "bf16", "attn_implementation": "sdpa", "torch": "2.11",
    "transformers": "5.17",
    "0.5b": {"raw_train": {"tokens_per_s": 74200, "mfu": 0.22, "micro_batch": 16, "batch": 64, "seq_len": 512,
                           "peak_mem_gb": 28},
             "raw_generate": {"new_tokens_per_s": 929, "batch": 64, "prompt_len": 256, "new_tokens": 64}},
    "1.5b": {"raw_train": {"tokens_per_s": 36400, "mfu": 0.34, "micro_batch": 16, "batch": 64, "seq_len": 512,
                           "peak_mem_gb": 48},
             "raw_generate": {"new_tokens_per_s": 716, "batch": 64, "prompt_len": 256, "new_tokens": 64}},
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]
QWEN25_TEMPLATE = (  # Qwen2.5's chat template without its tools branch (the bench plays a text family)
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# --------------------------------------------------------------------------- the model
def task_texts(tasks, tasks_dir) -> list[str]:
    """What the agent is shown in the tasks (the tokenizer's corpus): goals, observations, actions."""
    texts = list(PROBE_TEXTS)
    for t in tasks:
        env = make(t, tasks_dir)
        obs = env.reset()
        texts.append(observation_text(AgentFormat(), obs.text, obs.admissible, env.goal))
        texts += obs.admissible or []
        while (a := env.expert_action()) is not None:
            texts += [a, env.step(a).observation.text]
    return texts


def build_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=SPECIALS[1:])
    out.chat_template = QWEN25_TEMPLATE
    return out


def build_policy(shape: str, tasks, tasks_dir: Path, model_dir: Path, compute: ComputeParams, context: int,
                 tokenizer_vocab: int) -> Policy:
    """Tokenizer and config.json in `model_dir` (a Hugging Face directory without weights), the model
    drawn on its device at random (fast for 1.5B on a GPU), then placed by `compute`."""
    tok = build_tokenizer(task_texts(tasks, tasks_dir), tokenizer_vocab)
    check_tokenizer(tok, PROBE_TEXTS, str(model_dir))
    cfg = Qwen2Config(**SHAPES[shape], **QWEN_COMMON, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None)
    assert cfg.vocab_size >= len(tok), f"tokenizer ({len(tok)}) larger than the model's vocabulary"
    tok.save_pretrained(model_dir)
    cfg.save_pretrained(model_dir)
    torch.manual_seed(0)
    with torch.device(resolve_device(compute.device)):
        model = Qwen2ForCausalLM(cfg)
    policy = Policy(model.eval(), tok, AgentFormat(), context, f"qwen2.5-{shape}-random")
    policy.chat  # noqa: B018  (the template splits into append-only pieces, as at load)
    return place(policy, compute)


# --------------------------------------------------------------------------- measuring
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Phase:
    """Wall time and peak memory of one phase (CUDA: max allocated since its start; CPU: the process's
    peak RSS so far, which only grows)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self.peak_gb = device, 0.0, 0.0

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        sync(self.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        sync(self.device)
        self.seconds = time.perf_counter() - self.t0
        if self.device.type == "cuda":
            self.peak_gb = torch.cuda.max_memory_allocated(self.device) / 2**30
        else:
            self.peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        return False


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    if given is not None:
        return given
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS if k in name), None)


def mfu(flops_per_token: float, tokens_per_s: float, peak: float | None) -> float | None:
    return None if peak is None else round(flops_per_token * tokens_per_s / (peak * 1e12), 4)


def rollout_phase(policy: Policy, tasks, tasks_dir, args, device) -> tuple[list, dict]:
    def agent(seed):
        return PolicyAgent(policy, temperature=1.0, seed=seed, batch_size=args.rollout_batch,
                           decoding={"default": "free"}, max_reply_tokens=args.max_reply_tokens)

    run_episodes(agent(1), tasks[:1], tasks_dir, max_turns=1)  # warm-up (CUDA context, kernels, caches)
    with Phase(device) as ph:
        episodes = run_episodes(agent(0), tasks, tasks_dir, args.max_turns, group_size=args.group_size)
    tokens = sum(len(ep.ids) for ep in episodes)
    generated = sum(t.n_tokens for ep in episodes for t in ep.turns)
    turns = sum(len(ep.turns) for ep in episodes)
    return episodes, {
        "episodes": len(episodes), "turns": turns, "tokens": tokens, "generated_tokens": generated,
        "seconds": round(ph.seconds, 3), "tokens_per_s": round(tokens / ph.seconds, 1),
        "generated_tokens_per_s": round(generated / ph.seconds, 1), "peak_mem_gb": round(ph.peak_gb, 3),
    }


def update_phase(policy: Policy, episodes, args, device) -> dict:
    batch = build_batch(episodes, policy.pad_id)
    gen = torch.Generator().manual_seed(0)
    batch.advantages = torch.randn(batch.rows, 1, generator=gen) * batch.loss_mask
    p = RLParams(algorithm="grpo", minibatch_size=batch.rows, micro_batch_size=args.micro_batch, ppo_epochs=1,
                 kl_coef=0.0, lr=1e-6, decoding={"default": "free"})
    opt = torch.optim.AdamW(policy.trainable(), lr=p.lr, weight_decay=0.0)
    engine = LocalEngine(policy.model, opt, p.max_grad_norm, policy.trainable())
    update(engine, policy, None, batch, p, None, gen)  # warm-up: AdamW state, kernels
    with Phase(device) as ph:
        stats = [update(engine, policy, None, batch, p, None, gen) for _ in range(args.steps)]
    tokens = int(batch.attention_mask.sum())
    s = ph.seconds / args.steps
    return {"rows": batch.rows, "width": batch.input_ids.shape[1], "tokens": tokens, "reply_tokens": batch.n_tokens,
            "micro_batch": args.micro_batch, "steps": args.steps, "seconds_per_update": round(s, 3),
            "tokens_per_s": round(tokens / s, 1), "reply_tokens_per_s": round(batch.n_tokens / s, 1),
            "loss": stats[-1]["loss"], "grad_norm": stats[-1]["grad_norm"], "peak_mem_gb": round(ph.peak_gb, 3)}


@torch.no_grad()
def raw_generate(policy: Policy, args, device) -> dict:
    model, vocab = policy.model, policy.vocab_size
    model.eval()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, vocab, (args.gen_batch, args.prompt_len), generator=gen).to(device)
    mask = torch.ones_like(prompts)

    def run(n):
        with policy.autocast():
            return model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=policy.pad_id, eos_token_id=policy.chat.end_id)

    run(2)  # warm-up
    with Phase(device) as ph:
        out = run(args.new_tokens)
    new = int(out.shape[1] - args.prompt_len) * args.gen_batch
    total = args.gen_batch * (args.prompt_len + args.new_tokens)
    return {"batch": args.gen_batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "seconds": round(ph.seconds, 3), "new_tokens_per_s": round(new / ph.seconds, 1),
            "tokens_per_s": round(total / ph.seconds, 1), "peak_mem_gb": round(ph.peak_gb, 3)}


def raw_train(policy: Policy, args, device) -> dict:
    model, vocab = policy.model, policy.vocab_size
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab, (args.train_batch, args.train_len), generator=gen)
    opt = torch.optim.AdamW(policy.trainable(), lr=1e-6, weight_decay=0.0)
    tokens = args.train_batch * args.train_len
    losses = []

    def step():
        model.train()
        opt.zero_grad(set_to_none=True)
        for k in range(0, args.train_batch, args.micro_batch):
            x = ids[k : k + args.micro_batch].to(device)
            with policy.autocast():
                logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())
            (loss * x.shape[0] / args.train_batch).backward()
            losses.append(float(loss.detach()))
        opt.step()

    step()  # warm-up
    with Phase(device) as ph:
        for _ in range(args.steps):
            step()
    opt.state.clear()
    model.zero_grad(set_to_none=True)
    model.eval()
    s = ph.seconds / args.steps
    return {"batch": args.train_batch, "seq_len": args.train_len, "micro_batch": args.micro_batch, "steps": args.steps,
            "seconds_per_step": round(s, 3), "tokens_per_s": round(tokens / s, 1), "loss": losses[-1],
            "peak_mem_gb": round(ph.peak_gb, 3)}


def machine(device: torch.device) -> dict:
    out = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out |= {"device_name": torch.cuda.get_device_name(device), "cuda": torch.version.cuda,
                "device_memory_gb": round(props.total_memory / 2**30, 1), "cudnn": torch.backends.cudnn.version()}
    else:
        try:
            names = [l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                     if l.startswith("model name")]
        except OSError:
            names = []
        out["device_name"] = names[0] if names else out["cpu"]
    return out


# --------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="0.5b")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"])
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--lora", action="store_true", help="LoRA (r 16 on every projection): adapters train")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/gpu_rl_<shape>_<device>.json)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the device's dense bf16 peak (default: by GPU name)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--steps", type=int, default=3, help="timed updates / raw train steps")
    g = ap.add_argument_group("agentkiln rollout + update")
    g.add_argument("--tasks", type=int, default=16, help="FrozenLake tasks played")
    g.add_argument("--group-size", type=int, default=8, help="episodes per task")
    g.add_argument("--max-turns", type=int, default=4)
    g.add_argument("--max-reply-tokens", type=int, default=32)
    g.add_argument("--rollout-batch", type=int, default=64, help="episodes in lockstep (one KV cache)")
    g.add_argument("--context", type=int, default=2048, help="the agent's context window")
    g.add_argument("--micro-batch", type=int, default=16, help="rows per forward/backward (update and raw train)")
    g = ap.add_argument_group("raw Hugging Face loops")
    g.add_argument("--batch", type=int, default=64, help="sequences of raw generate and raw train")
    g.add_argument("--prompt-len", type=int, default=256, help="raw generate: prompt tokens")
    g.add_argument("--new-tokens", type=int, default=64, help="raw generate: new tokens")
    g.add_argument("--train-len", type=int, default=512, help="raw train: tokens per sequence")
    g.add_argument("--tokenizer-vocab", type=int, default=1000, help="BPE tokens (the model's vocabulary is padded)")
    args = ap.parse_args(argv)
    args.gen_batch = args.train_batch = args.batch
    if args.micro_batch < 1 or args.steps < 1:
        ap.error("--micro-batch and --steps must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    compute = ComputeParams(device=args.device, dtype=args.dtype, gradient_checkpointing=args.gradient_checkpointing,
                            attn_implementation=args.attn)
    device = resolve_device(compute.device)
    out = Path(args.out or f"bench/results/gpu_rl_{args.shape}_{device.type}.json")
    with tempfile.TemporaryDirectory(prefix="agentkiln-gpu-bench-") as tmp:
        tasks_dir = Path(tmp) / "tasks"
        tasks = synthesize_tasks("gym-toytext", args.tasks, seed=3, level="easy", out_dir=tasks_dir, game="frozenlake")
        t0 = time.perf_counter()
        policy = build_policy(args.shape, tasks, tasks_dir, Path(tmp) / "model", compute, args.context,
                              args.tokenizer_vocab)
        if args.lora:
            lora.add_lora(policy, LoRAParams(enabled=True), seed=0)
        build_s = time.perf_counter() - t0
        n_params = sum(p.numel() for p in policy.model.parameters())
        n_trainable = sum(p.numel() for p in policy.trainable())
        peak = peak_tflops(device, args.peak_tflops)
        print(f"gpu_rl: {args.shape} ({n_params / 1e6:.1f}M params) on {device}, {args.dtype}; "
              f"built in {build_s:.1f} s", file=sys.stderr)

        episodes, rollout = rollout_phase(policy, tasks, tasks_dir, args, device)
        rollout["mfu"] = mfu(2 * n_params, rollout["tokens_per_s"], peak)
        print(f"gpu_rl: rollout {rollout['tokens_per_s']:.0f} tok/s", file=sys.stderr)
        upd = update_phase(policy, episodes, args, device)
        upd["mfu"] = mfu(6 * n_params, upd["tokens_per_s"], peak)
        print(f"gpu_rl: update {upd['tokens_per_s']:.0f} tok/s", file=sys.stderr)
        del episodes
        gen = raw_generate(policy, args, device)
        gen["mfu"] = mfu(2 * n_params, gen["tokens_per_s"], peak)
        print(f"gpu_rl: raw generate {gen['new_tokens_per_s']:.0f} new tok/s", file=sys.stderr)
        train = raw_train(policy, args, device)
        train["mfu"] = mfu(6 * n_params, train["tokens_per_s"], peak)
        print(f"gpu_rl: raw train {train['tokens_per_s']:.0f} tok/s", file=sys.stderr)

    result = {
        "bench": "gpu_rl",
        "shape": args.shape,
        "model": {"arch": "Qwen2ForCausalLM (random init)", **SHAPES[args.shape], **QWEN_COMMON,
                  "tokenizer_vocab": len(policy.tokenizer), "params": n_params, "trainable_params": n_trainable},
        "settings": {"device": args.device, "dtype": args.dtype, "attn_implementation": args.attn,
                     "gradient_checkpointing": args.gradient_checkpointing, "lora": args.lora,
                     "tasks": args.tasks, "family": "gym-toytext/frozenlake easy", "group_size": args.group_size,
                     "max_turns": args.max_turns, "max_reply_tokens": args.max_reply_tokens, "decoding": "free",
                     "rollout_batch": args.rollout_batch, "context": args.context, "micro_batch": args.micro_batch,
                     "steps": args.steps, "batch": args.batch, "prompt_len": args.prompt_len,
                     "new_tokens": args.new_tokens, "train_len": args.train_len, "peak_tflops": peak},
        "machine": machine(device),
        "build_s": round(build_s, 2),
        "agentkiln": {"rollout": rollout, "update": upd},
        "raw_hf": {"generate": gen, "train": train},
        "update_vs_raw_train": round(upd["tokens_per_s"] / train["tokens_per_s"], 3),
        "mfu_formula": "6*N*tokens/s (update, raw train) or 2*N*tokens/s (rollout, generate) over peak_tflops; "
                       "N = params; null without a peak (CPU)",
        "peak_mem": "cuda: torch.cuda.max_memory_allocated per phase; cpu: process peak RSS so far (ru_maxrss)",
        "reference": {k: v for k, v in REFERENCE.items() if k in ("device", "dtype", "attn_implementation", "torch",
                                                                   "transformers", args.shape)},
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    assert all(math.isfinite(x) for x in (upd["loss"], train["loss"])), "non-finite loss"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
