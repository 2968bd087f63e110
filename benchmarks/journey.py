"""The GPU user's journey: every packaged recipe and real-width slices of the full-size SFT recipes,
run through the installed ``lightning-moe`` commands from a directory outside the repository.

``bash benchmarks/h200.sh journey`` builds a wheel from the checkout, installs it into a fresh
target and runs this script from a scratch directory with only that target on ``PYTHONPATH``; the
kernels then build from the wheel's own sources. What it does:

1. **Recipes.** Every packaged recipe except the full-size ones (``lightning-moe recipes``), made a
   one-GPU run the way a user edits a copy: ``accelerator: gpu``, ``devices: 1``, every parallel
   degree 1, the FP8 recipe with its GPU backend (``backend: emulate`` dropped), the callbacks
   recipe with ``CPUOffload`` added and ``CUDAGraphCapture`` where there is no autocast (its own
   precision and ``bf16-true``); at the recipe's own precision and at ``bf16-mixed``, ``--steps``
   optimizer steps (>= 100). Passes when the run reaches its last step
   and the validation loss at the end is finite and lower than before the first step.
2. **Full-size slices.** Each full-size SFT recipe (``*_sft``, ``hf_qwen3_moe_long_context``) on a
   random checkpoint of its family at its real hidden size, expert count and expert width, two
   layers, saved with ``save_pretrained`` (sharded safetensors), a byte-level BPE tokenizer
   trained here (``train_bpe_tokenizer``) and a chat ``.jsonl``:
   sharded load -> ``--slice-steps`` SFT steps -> DCP checkpoint -> the process killed (SIGKILL)
   -> resumed from ``last`` -> as many steps again -> ``lightning-moe-export`` -> transformers loads
   the export and its logits match ours (read from the DCP checkpoint) -> ``lightning-moe
   generate`` prints text.

Every run prints the step time and peak memory (``lightning_moe.callbacks.StepTimer``). The loss
column is the validation loss at the first and last validation of the fit (``val``: a recipe run
validates in its sanity check and every ``--steps // 2`` steps) or, where the fit validated once or
never, the training loss of the first and last logged steps from the CSV metrics (``train``: a
slice's resumed fit validates only at its end, since Lightning skips the sanity check on resume; that
one validation loss goes to the notes). The table goes to stdout and, with ``--out``, to a JSON file.
Exit status 1 when any row failed. ``--accelerator cpu --tiny`` runs the same journey on the CPU
with small dimensions (a check of the script itself).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

_DEGREES = ("tp", "cp", "ep", "etp", "edp", "pp")
_STEP_LINE = re.compile(r"^step time: ([\d.]+) ms median", re.M)
_PEAK_LINE = re.compile(r"^step time: .*peak memory: ([\d.]+) GiB allocated", re.M)
_VAL_LINE = re.compile(r"validation loss: (\S+) at step (\d+) -> (\S+) at step (\d+)")
_TIMER = {"class_path": "lightning_moe.callbacks.StepTimer", "init_args": {"skip_steps": 5}}
_VAL_BATCHES = 4  # validation batches of every run

# recipe -> (HF model_type, the released model's dimensions that a two-layer slice keeps)
SLICES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_30b_a3b_sft": ("qwen3_moe", dict(
        hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)),
    "hf_qwen3_moe_long_context": ("qwen3_moe", dict(  # the same model; its cp and sequence parallel need 2+ GPUs
        hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)),
    "deepseek_v2_lite_sft": ("deepseek_v2", dict(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, intermediate_size=10944,
        moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, routed_scaling_factor=1.0, topk_method="greedy", q_lora_rank=None,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, norm_topk_prob=False)),
    "mixtral_8x7b_sft": ("mixtral", dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
        num_local_experts=8, num_experts_per_tok=2)),  # 2.9 B parameters in two layers
    "gpt_oss_20b_sft": ("gpt_oss", dict(
        hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64, intermediate_size=2880,
        num_local_experts=32, num_experts_per_tok=4, layer_types=["sliding_attention", "full_attention"],
        sliding_window=128, max_position_embeddings=131072)),
}  # fmt: skip
# Recipe settings a slice changes to fit one machine, with the reason (printed in its row).
SLICE_OVERRIDES: dict[str, tuple[dict[str, Any], str]] = {
    # fp32 weights + AdamW are 12 bytes a parameter: two 35 GB checkpoints (the published one and the
    # one being written) would not fit a 64 GB disk
    "mixtral_8x7b_sft": ({"dtype": "bfloat16"}, "bf16 weights and AdamW states (fp32 would need 70 GB of checkpoint disk)"),
}
_TINY = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, head_dim=16, num_attention_heads=4,
             num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
             num_experts=8, n_routed_experts=8, num_local_experts=8, sliding_window=16)  # fmt: skip
QUESTIONS = [
    ("What is the capital of France?", "Paris is the capital."),
    ("How are you today?", "I am fine, thank you."),
    ("Count from one to five.", "One two three four five."),
    ("Which animal jumps over the dog?", "The quick brown fox."),
    ("What does a router do?", "It routes each token to a few experts."),
    ("Count from six to ten.", "Six seven eight nine ten."),
]


@dataclass
class Row:
    """One line of the journey's table."""

    what: str
    precision: str
    ok: bool = False
    steps: int = 0
    loss_kind: str = ""  # "val" or "train": which loss loss_first and loss_last are
    loss_first: float | None = None
    loss_last: float | None = None
    loss_steps: tuple[int, int] | None = None  # the steps of loss_first and loss_last
    ms_per_step: float | None = None
    peak_gib: float | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


# --- running the installed commands ---------------------------------------------------------------


def run(cmd: list[str], cwd: Path, timeout: float, log: Path) -> tuple[int, str]:
    """``cmd`` in its own process group; its output is kept in ``log`` and returned."""
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = -9
    return rc, log.read_text(errors="replace")


def read_fit(out: str, row: Row, work: Path) -> None:
    """A fit's loss and StepTimer lines into ``row``: the validation loss first -> last when the fit
    validated at two steps, else the training loss first -> last of the CSV metrics under ``work``."""
    val, train = _VAL_LINE.search(out), train_losses(work)
    if val:
        row.steps = int(val.group(4))
    if val and val.group(2) != val.group(4):
        row.loss_kind, row.loss_first, row.loss_last = "val", float(val.group(1)), float(val.group(3))
        row.loss_steps = (int(val.group(2)), int(val.group(4)))
    elif len(train) >= 2:
        (first_step, first), (last_step, last) = train[0], train[-1]
        row.loss_kind, row.loss_first, row.loss_last, row.loss_steps = "train", first, last, (first_step, last_step)
        row.steps = row.steps or last_step
    if val and row.loss_kind != "val":
        row.notes.append(f"one validation: loss {float(val.group(3)):.4g} at step {val.group(4)}")
    timed, peak = _STEP_LINE.findall(out), _PEAK_LINE.findall(out)
    row.ms_per_step = float(timed[-1]) if timed else None
    row.peak_gib = float(peak[-1]) if peak else None


def train_losses(work: Path) -> list[tuple[int, float]]:
    """``(step, train/loss)`` of every CSVLogger ``metrics.csv`` under ``work`` (a killed fit's and the
    fit resumed from it), by step; ``step`` counts optimizer steps, the logged batch's included."""
    import csv

    losses: dict[int, float] = {}
    for path in sorted(work.rglob("metrics.csv")):
        with path.open(newline="") as f:
            for record in csv.DictReader(f):
                if record.get("train/loss") and record.get("step"):
                    losses[int(record["step"]) + 1] = float(record["train/loss"])
    return sorted(losses.items())


def tail(out: str, lines: int = 25) -> str:
    return "\n".join(out.splitlines()[-lines:])


def packaged_recipes() -> dict[str, Path]:
    """Name -> file of every recipe the installed package carries (``lightning-moe recipes``)."""
    out = subprocess.run(["lightning-moe", "recipes"], check=True, capture_output=True, text=True).stdout
    pairs = (line.split(None, 1) for line in out.splitlines() if line.strip())
    return {name: Path(path.strip()) for name, path in pairs}


# --- the recipes on one device -------------------------------------------------------------------


def one_device(config: dict[str, Any], accelerator: str, precision: str, steps: int) -> dict[str, Any]:
    """A copy of ``config`` as a user edits it for one device, ``steps`` steps at ``precision``."""
    trainer = config["trainer"]
    trainer.update(accelerator=accelerator, devices=1, precision=precision, max_steps=steps,
                   val_check_interval=steps // 2, limit_val_batches=_VAL_BATCHES,
                   enable_progress_bar=False)  # fmt: skip
    trainer.pop("num_nodes", None)
    strategy = trainer.get("strategy")
    if isinstance(strategy, dict):
        args = strategy.setdefault("init_args", {})
        for key in _DEGREES:
            if key in args:
                args[key] = 1
        for key in ("sequence_parallel", "vocab_parallel"):
            if args.get(key):
                args[key] = False
    trainer["callbacks"] = [*(trainer.get("callbacks") or []), _TIMER]
    if accelerator == "gpu":
        _drop_emulated_fp8(config["model"])
    return config


def _drop_emulated_fp8(node: Any) -> None:
    """Remove ``backend: emulate`` from every ``fp8`` block (the GPU picks its own backend)."""
    if isinstance(node, dict):
        fp8 = node.get("fp8")
        if isinstance(fp8, dict) and fp8.get("backend") == "emulate":
            del fp8["backend"]
        for value in node.values():
            _drop_emulated_fp8(value)
    elif isinstance(node, list):
        for value in node:
            _drop_emulated_fp8(value)


def _with_memory_callbacks(config: dict[str, Any], precision: str) -> dict[str, Any]:
    """The callbacks recipe with activation offload and, where the precision has no autocast
    (CUDAGraphCapture refuses ``*-mixed``: a captured graph would not follow autocast), CUDA graphs."""
    added = [{"class_path": "lightning_moe.callbacks.CPUOffload", "init_args": {"activations": ["*layers.*"]}}]
    if not precision.endswith("-mixed"):
        added.append({"class_path": "lightning_moe.callbacks.CUDAGraphCapture", "init_args": {"warmup_steps": 3}})
    config["trainer"]["callbacks"] += added
    return config


def recipe_rows(args: argparse.Namespace, recipes: dict[str, Path], work: Path) -> list[Row]:
    """Every recipe at its own precision and at bf16-mixed; ``--jobs`` runs at a time on the one GPU
    (more than one shares the device, so the step times are then upper bounds)."""
    from concurrent.futures import ThreadPoolExecutor

    runs = []
    for name, path in sorted(recipes.items()):
        if name in SLICES:
            continue
        own = str(yaml.safe_load(path.read_text())["trainer"].get("precision", "32-true"))
        own = "32-true" if own in ("32", "32-true") else own
        extra = ["bf16-true"] if name == "tiny_moe_callbacks" else []  # CUDA graphs in bf16 (no autocast)
        runs += [(name, path, precision) for precision in dict.fromkeys([own, "bf16-mixed", *extra])]

    def one(run: tuple[str, Path, str]) -> Row:
        name, path, precision = run
        row = recipe_row(args, name, path, precision, work / f"{name}-{precision}")
        print(format_row(row), flush=True)
        return row

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        return list(pool.map(one, runs))


def recipe_row(args: argparse.Namespace, name: str, path: Path, precision: str, work: Path) -> Row:
    work.mkdir(parents=True, exist_ok=True)
    config = one_device(yaml.safe_load(path.read_text()), args.accelerator, precision, args.steps)
    if name == "tiny_moe_callbacks" and args.accelerator == "gpu":
        config = _with_memory_callbacks(config, precision)
    if args.tiny:
        config["data"].setdefault("init_args", {}).update(seq_len=32, batch_size=4, max_bytes=100_000)
    (work / "recipe.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    row, start = Row(name, precision), time.time()
    rc, out = run(["lightning-moe", "fit", "--config", "recipe.yaml"], work, args.timeout, work / "fit.log")
    row.seconds = time.time() - start
    read_fit(out, row, work)
    reached = f"`max_steps={args.steps}` reached" in out
    first, last = (row.loss_first, row.loss_last) if row.loss_kind == "val" else (None, None)
    lower = first is not None and last is not None and last < first
    row.ok = rc == 0 and reached and lower
    if not row.ok:
        row.notes.append(f"exit {rc}, reached={reached}, loss lower={lower}: {work / 'fit.log'}")
        print(tail(out), flush=True)
    return row


# --- real-width slices of the full-size SFT recipes ------------------------------------------------


def make_checkpoint(folder: Path, family: str, dims: dict[str, Any], device: str) -> None:
    """A random two-layer ``family`` model at ``dims``, its tokenizer and config, as a downloaded
    checkpoint directory holds them (bf16 sharded safetensors with an index)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_moe.data.tokenizer import train_bpe_tokenizer

    text = " ".join(q + " " + a for q, a in QUESTIONS) * 20
    tok = train_bpe_tokenizer([text], vocab_size=512, generation=True)
    tok.save_pretrained(folder)
    config = AutoConfig.for_model(
        family, vocab_size=len(tok), num_hidden_layers=2, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **dims,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="1GB")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def write_chats(path: Path, n: int) -> None:
    with path.open("w") as f:
        for i in range(n):
            question, reply = QUESTIONS[i % len(QUESTIONS)]
            chat = [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
            f.write(json.dumps({"messages": chat}) + "\n")


def slice_config(path: Path, args: argparse.Namespace, checkpoint: Path, chats: Path, work: Path) -> dict[str, Any]:
    """The recipe as a user edits it for one device and this checkpoint: a DCP checkpoint every
    ``slice_steps`` steps, ``2 * slice_steps`` steps in all."""
    steps = 2 * args.slice_steps
    config = one_device(yaml.safe_load(path.read_text()), args.accelerator, "bf16-mixed", steps)
    trainer = config["trainer"]
    trainer.update(val_check_interval=args.slice_steps, num_sanity_val_steps=0, accumulate_grad_batches=1)
    for callback in trainer["callbacks"]:
        if callback["class_path"].endswith("ModelCheckpoint"):
            callback["init_args"].update(dirpath=str(work / "checkpoints"), every_n_train_steps=args.slice_steps)
    model = config["model"]["init_args"]
    model.update(pretrained=str(checkpoint), **SLICE_OVERRIDES.get(path.stem, ({}, ""))[0])
    optimizer = {"learning_rate": 3e-4, "warmup_steps": 5}
    if isinstance(model.get("optimizer"), dict):
        model["optimizer"].update(optimizer)
    else:
        model.update(optimizer)
    if args.tiny:
        model["moe"] = {**model.get("moe", {}), "experts_backend": "torch"}
    data = config["data"]["init_args"]
    data.update(tokenizer_dir=str(checkpoint), train_files=str(chats), val_fraction=0.05,
                seq_len=256 if args.tiny else 2048, batch_size=1, num_workers=0)  # fmt: skip
    return config


def slice_row(args: argparse.Namespace, name: str, path: Path, work: Path) -> Row:
    family, dims = SLICES[name]
    dims = {k: (_TINY[k] if args.tiny and k in _TINY else v) for k, v in dims.items()}
    if family == "deepseek_v2":  # multi-head latent attention: as many key/value heads as query heads
        dims["num_key_value_heads"] = dims["num_attention_heads"]
    row, start = Row(f"{name} (2 layers, real width)", "bf16-mixed"), time.time()
    if name in SLICE_OVERRIDES:
        row.notes.append(SLICE_OVERRIDES[name][1])
    work.mkdir(parents=True, exist_ok=True)
    checkpoint, chats = work / "hf", work / "chats.jsonl"
    make_checkpoint(checkpoint, family, dims, "cuda" if args.accelerator == "gpu" else "cpu")
    write_chats(chats, 4000)
    (work / "recipe.yaml").write_text(yaml.safe_dump(slice_config(path, args, checkpoint, chats, work), sort_keys=False))
    try:
        _slice_steps(args, work, row)
    except _StepFailed as failed:
        row.notes.append(str(failed))
    row.seconds = time.time() - start
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return row


class _StepFailed(Exception):
    pass


def _check(ok: bool, what: str, out: str = "") -> None:
    if not ok:
        if out:
            print(tail(out, 40), flush=True)
        raise _StepFailed(what)


def _slice_steps(args: argparse.Namespace, work: Path, row: Row) -> None:
    last = work / "checkpoints" / "last.ckpt"
    killed = _fit_until_checkpoint(work, last, args.timeout)
    _check(killed, "the first fit wrote no DCP checkpoint before it ended")
    row.notes.append("killed after the first checkpoint")
    rc, out = run(["lightning-moe", "fit", "--config", "recipe.yaml", "--ckpt_path", str(last)], work, args.timeout,
                  work / "resume.log")  # fmt: skip
    _check(rc == 0 and f"`max_steps={2 * args.slice_steps}` reached" in out, f"resume failed (exit {rc})", out)
    _check("Restored all states from the checkpoint" in out, "the second fit did not resume from the checkpoint", out)
    read_fit(out, row, work)
    export = work / "export"
    rc, out = run(["lightning-moe-export", str(last), str(export)], work, args.timeout, work / "export.log")
    _check(rc == 0 and (export / "config.json").is_file(), f"export failed (exit {rc})", out)
    compare = [sys.executable, str(Path(__file__).resolve()), "compare", str(last), str(export), args.accelerator]
    rc, out = run(compare, work, args.timeout, work / "compare.log")
    _check(rc == 0, f"transformers' logits of the export differ from ours (exit {rc})", out)
    row.notes.append(out.strip().splitlines()[-1])
    device = "cuda" if args.accelerator == "gpu" else "cpu"
    generate = ["lightning-moe", "generate", "--checkpoint", str(export), "--tokenizer", str(work / "hf"),
                "--prompt", QUESTIONS[0][0], "--chat", "--greedy", "--max_new_tokens", "12", "--device", device,
                "--swap_moe"]  # fmt: skip
    rc, out = run(generate, work, args.timeout, work / "generate.log")
    _check(rc == 0 and out.strip() != "", f"generate failed (exit {rc})", out)
    row.notes.append("generate: " + out.strip().splitlines()[-1][:60])
    row.ok = True


def _fit_until_checkpoint(work: Path, last: Path, timeout: float) -> bool:
    """Start the fit, SIGKILL it once its first DCP checkpoint is published; True when one was."""
    log = (work / "fit.log").open("w")
    proc = subprocess.Popen(["lightning-moe", "fit", "--config", "recipe.yaml"], cwd=work, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not (last / "manifest.json").is_file():
        time.sleep(0.5)
    published = (last / "manifest.json").is_file()
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    log.close()
    if not published:
        print(tail((work / "fit.log").read_text(errors="replace"), 40), flush=True)
    return published


def compare_logits(checkpoint: str, export: str, accelerator: str) -> None:
    """``python3 journey.py compare DCP EXPORT ACCELERATOR``: transformers' logits of the export
    against ours read from the DCP checkpoint, fp32 on both sides; fails above 1 % of the largest logit."""
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_moe.generate import load_model

    device = "cuda" if accelerator == "gpu" else "cpu"
    ours = load_model(checkpoint, device=device).module.float().eval()
    theirs = AutoModelForCausalLM.from_pretrained(export, torch_dtype=torch.float32, attn_implementation="eager")
    theirs = theirs.to(device).eval()
    ids = torch.randint(0, theirs.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        a, b = ours(ids).float(), theirs(input_ids=ids).logits.float()
    err = ((a - b).abs().max() / b.abs().max()).item()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"logits vs transformers: max |diff| {err:.2e} of the largest, argmax agrees {100 * agree:.1f} %")
    sys.exit(0 if err < 1e-2 and agree > 0.98 else 1)


# --- the table -------------------------------------------------------------------------------------


def format_row(row: Row) -> str:
    def num(x: float | None, fmt: str) -> str:
        return "—" if x is None else format(x, fmt)

    loss = "—"
    if row.loss_kind:  # 4 significant digits: a loss near zero is not rounded to 0.000
        first_step, last_step = row.loss_steps or (0, 0)
        loss = (f"{row.loss_kind} {num(row.loss_first, '.4g')} (step {first_step}) → "
                f"{num(row.loss_last, '.4g')} (step {last_step})")  # fmt: skip
    return (f"| {row.what} | {row.precision} | {'pass' if row.ok else 'FAIL'} | {row.steps} | {loss} | "
            f"{num(row.ms_per_step, '.1f')} | {num(row.peak_gib, '.2f')} | {row.seconds:.0f} | {'; '.join(row.notes)} |")  # fmt: skip


HEADER = ("| run | precision | result | steps | loss first → last (val or train) | ms/step | peak GiB | wall s | notes |\n"
          "|---|---|---|---|---|---|---|---|---|")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        compare_logits(*argv[1:4])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path("journey_runs"))
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--only", choices=["all", "recipes", "slices"], default="all")
    p.add_argument("--select", default="", help="comma-separated recipe names (default: every one)")
    p.add_argument("--accelerator", choices=["gpu", "cpu"], default="gpu")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--slice-steps", type=int, default=50)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--jobs", type=int, default=1, help="recipe runs at a time (default 1: clean step times)")
    p.add_argument("--tiny", action="store_true", help="small dimensions (a check of this script on the CPU)")
    p.add_argument("--keep", action="store_true", help="keep each slice's checkpoints and exports")
    args = p.parse_args(argv)
    import lightning_moe

    print(f"lightning_moe from {Path(lightning_moe.__file__).parent}", flush=True)
    recipes = packaged_recipes()
    if args.select:
        recipes = {k: v for k, v in recipes.items() if k in args.select.split(",")}
    args.work.mkdir(parents=True, exist_ok=True)
    print(HEADER, flush=True)
    rows = recipe_rows(args, recipes, args.work) if args.only in ("all", "recipes") else []
    if args.only in ("all", "slices"):
        for name in [n for n in SLICES if n in recipes]:
            rows.append(slice_row(args, name, recipes[name], args.work / name))
            print(format_row(rows[-1]), flush=True)
    print("\n" + HEADER + "\n" + "\n".join(format_row(r) for r in rows))
    if args.out is not None:
        args.out.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    failed = [r.what + " " + r.precision for r in rows if not r.ok]
    print(f"journey: {len(rows) - len(failed)} of {len(rows)} passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
