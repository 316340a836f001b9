"""lm-evaluation-harness on gyrfalcon vs. on HF transformers: same tasks, same model.

Starts `gyrfalcon serve MODEL --dtype float32 --device cpu`, runs lm-eval with
`--model local-completions` against it and with `--model hf` (float32, CPU), both
on the local tasks of benchmarks/lm_eval_tasks/ with --log_samples, then writes
the scores side by side plus a per-request comparison (largest loglikelihood
difference, is_greedy and generation mismatches) as JSON and markdown.

lm-eval lives in its own virtualenv (it pins packages the project does not):

    python3 -m venv /work/lmeval-venv && /work/lmeval-venv/bin/pip install torch==2.13.0 \\
        && /work/lmeval-venv/bin/pip install "lm-eval[api,hf]"
    python benchmarks/lm_eval_compare.py --lm-eval-python /work/lmeval-venv/bin/python

Run it with the project's python (it imports gyrfalcon to find the model); lm-eval
runs in the repository root, which the tasks' data paths are relative to.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TASK_TYPES = {  # task -> lm-eval output_type
    "gyrfalcon_capitals": "multiple_choice",
    "gyrfalcon_capitals_chat": "multiple_choice",
    "gyrfalcon_docs": "loglikelihood_rolling",
    "gyrfalcon_arith": "generate_until",
}
TASKS = list(TASK_TYPES)
LOGLIK_TOL = 1e-4  # per request, as test/e2e/test_lm_eval_shapes.py
STARTUP_TIMEOUT_S = 600


def provenance() -> dict:
    """The commit, and whether the served code had uncommitted changes (their hash)."""
    from gyrfalcon.bench.provenance import git_commit

    try:
        cmd = ["git", "diff", "HEAD", "--", "python"]
        diff = subprocess.check_output(cmd, cwd=ROOT, text=True, stderr=subprocess.DEVNULL)
    except (OSError, subprocess.CalledProcessError):
        diff = ""
    return {
        "commit": git_commit(),
        "python_dirty": bool(diff),
        "python_diff_sha1": hashlib.sha1(diff.encode()).hexdigest()[:12] if diff else None,
    }


def run_lm_eval(python: str, model: str, model_args: str, out: Path, extra: list[str]) -> list:
    cmd = [python, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args]
    cmd += ["--include_path", "benchmarks/lm_eval_tasks", "--tasks", *TASKS]
    cmd += ["--log_samples", "--output_path", str(out), *extra]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    print("+", " ".join(cmd), flush=True)
    with (out.parent / f"lm_eval_{out.name}.log").open("w") as log:
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return cmd


def load_run(out: Path) -> tuple[dict, dict[str, dict[int, dict]]]:
    """(results['results'], task -> doc_id -> sample) of the newest run under out."""
    results = max(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    stamp = results.stem.removeprefix("results_")  # the run's samples files share it
    samples = {}
    for task in TASKS:
        path = results.parent / f"samples_{task}_{stamp}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        samples[task] = {r["doc_id"]: r for r in rows}
    return json.loads(results.read_text())["results"], samples


def compare_samples(output_type: str, a: dict[int, dict], b: dict[int, dict]) -> dict:
    """Per-request comparison of one task's samples (a = server, b = HF).

    A sample's `resps` holds one list per request: [[loglikelihood, is_greedy]] for
    multiple choice, [loglikelihood] for rolling, [text] for generate_until (the
    samples file writes numbers and booleans as strings).
    """
    assert a.keys() == b.keys()
    n, max_diff, ll_mismatch, greedy_mismatch, gen_mismatch, examples = 0, 0.0, 0, 0, 0, []
    for doc_id in sorted(a):
        for ra, rb in zip(a[doc_id]["resps"], b[doc_id]["resps"]):
            n += 1
            if output_type == "generate_until":
                if ra[0] != rb[0]:
                    gen_mismatch += 1
                    examples.append({"doc_id": doc_id, "server": ra[0], "hf": rb[0]})
                continue
            va, vb = (ra[0], rb[0]) if output_type == "multiple_choice" else (ra, rb)
            diff = abs(float(va[0]) - float(vb[0]))
            max_diff = max(max_diff, diff)
            ll_mismatch += diff > LOGLIK_TOL
            if output_type == "multiple_choice" and va[1] != vb[1]:
                greedy_mismatch += 1
            if diff > LOGLIK_TOL or (output_type == "multiple_choice" and va[1] != vb[1]):
                examples.append({"doc_id": doc_id, "server": va, "hf": vb})
    return {
        "requests": n,
        "max_abs_loglikelihood_diff": max_diff,
        "loglikelihood_mismatches": ll_mismatch,
        "is_greedy_mismatches": greedy_mismatch,
        "generation_mismatches": gen_mismatch,
        "agree": max_diff <= LOGLIK_TOL and not greedy_mismatch and not gen_mismatch,
        "examples": examples[:5],
    }


def metric_rows(server: dict, hf: dict) -> list[dict]:
    rows = []
    for task in TASKS:
        for key, value in sorted(server[task].items()):
            skip = key in ("alias", "sample_len") or "stderr" in key
            if skip or not isinstance(value, (int, float)):
                continue
            metric = key.split(",")[0]
            rows.append({"task": task, "metric": metric, "server": value, "hf": hf[task][key]})
    return rows


def write_markdown(path: Path, record: dict) -> None:
    lines = [
        f"# lm-eval on gyrfalcon vs. HF transformers (device: {record['device']})",
        "",
        f"SmolLM2-135M-Instruct, float32. lm-eval {record['lm_eval_version']}; "
        f"`local-completions` against `gyrfalcon serve --dtype float32 --device cpu` "
        f"(commit {record['gyrfalcon']['commit']}"
        + (
            f", uncommitted python/ changes {record['gyrfalcon']['python_diff_sha1']}"
            if record["gyrfalcon"]["python_dirty"]
            else ""
        )
        + f") vs. `--model hf` (transformers {record['hf_transformers_version']}). "
        f"Tasks: benchmarks/lm_eval_tasks/. Re-run: `{record['rerun']}`.",
        "",
        *([record["note"], ""] if record["note"] else []),
        "| task | metric | server | hf | server - hf |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for r in record["metrics"]:
        lines.append(
            f"| {r['task']} | {r['metric']} | {r['server']:.6g} | {r['hf']:.6g} "
            f"| {r['server'] - r['hf']:+.3g} |"
        )
    lines += [
        "",
        f"Per request (agree = every loglikelihood within {LOGLIK_TOL:g}, same is_greedy, "
        "same generated text):",
        "",
        "| task | requests | max abs loglikelihood diff | loglikelihoods off "
        "| is_greedy mismatches | generation mismatches | agree |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for task, c in record["per_request"].items():
        lines.append(
            f"| {task} | {c['requests']} | {c['max_abs_loglikelihood_diff']:.3g} "
            f"| {c['loglikelihood_mismatches']} "
            f"| {c['is_greedy_mismatches']} | {c['generation_mismatches']} "
            f"| {'yes' if c['agree'] else 'NO'} |"
        )
    path.write_text("\n".join(lines) + "\n")


def run_both(args: argparse.Namespace, work: Path) -> dict:
    """Serve, run lm-eval against the server and against HF; return what was run."""
    from gyrfalcon.bench.server_proc import running_server
    from gyrfalcon.loader.resolve import resolve_model

    model_dir = resolve_model(args.model)
    limit = ["--limit", str(args.limit)] if args.limit else []
    info = {"gyrfalcon": provenance(), "date": time.strftime("%Y-%m-%d")}  # the served code
    cmd = [sys.executable, "-m", "gyrfalcon.cli", "serve", model_dir, "--port", str(args.port)]
    cmd += ["--dtype", "float32", "--device", "cpu"]
    with running_server(cmd, args.port, work / "server.log", STARTUP_TIMEOUT_S, ROOT / "python"):
        base = f"http://127.0.0.1:{args.port}"
        served = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        server_args = (
            f"model={served},base_url={base}/v1/completions,tokenizer={model_dir},"
            f"tokenizer_backend=huggingface,num_concurrent={args.num_concurrent},max_retries=1"
        )
        server_cmd = run_lm_eval(
            args.lm_eval_python, "local-completions", server_args, work / "server", limit
        )
    hf_args = f"pretrained={model_dir},dtype=float32"
    hf_extra = ["--device", "cpu", "--batch_size", "1", *limit]
    hf_cmd = run_lm_eval(args.lm_eval_python, "hf", hf_args, work / "hf", hf_extra)
    versions = subprocess.check_output(
        [
            args.lm_eval_python,
            "-c",
            "import importlib.metadata as m;"
            "print(m.version('lm_eval'), m.version('transformers'), m.version('torch'))",
        ],
        text=True,
    ).split()
    info.update(
        lm_eval_version=versions[0],
        hf_transformers_version=versions[1],
        hf_torch_version=versions[2],
        model=model_dir if args.model else "SmolLM2-135M-Instruct (the embedded GGUF, converted)",
        commands={"server": server_cmd, "hf": hf_cmd},
    )
    (work / "run.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lm-eval-python", default=sys.executable, help="a python with lm-eval")
    ap.add_argument("--model", default=None, help="HF dir (default: the embedded SmolLM2)")
    ap.add_argument("--port", type=int, default=8012)
    ap.add_argument("--num-concurrent", type=int, default=1)
    ap.add_argument("--limit", type=int, default=None, help="documents per task (a quick check)")
    ap.add_argument("--work-dir", default="/tmp/gyrfalcon-lm-eval", help="lm-eval's outputs")
    ap.add_argument(
        "--compare-only", action="store_true", help="re-read the work dir's runs, run nothing"
    )
    ap.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--name", default="lm_eval_cpu_smollm2", help="result file stem")
    ap.add_argument("--note", default="", help="a sentence for the record (what was served)")
    args = ap.parse_args()

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if args.compare_only:
        info = json.loads((work / "run.json").read_text())
    else:
        info = run_both(args, work)
    server_res, server_samples = load_run(work / "server")
    hf_res, hf_samples = load_run(work / "hf")
    record = {
        "bench": "lm_eval_compare",
        "device": f"cpu ({os.cpu_count()} cores)",
        "cpu": platform.processor() or platform.machine(),
        **info,
        "tasks": TASKS,
        "rerun": "python benchmarks/lm_eval_compare.py --lm-eval-python PYTHON_WITH_LM_EVAL",
        "note": args.note,
        "metrics": metric_rows(server_res, hf_res),
        "per_request": {
            t: compare_samples(TASK_TYPES[t], server_samples[t], hf_samples[t]) for t in TASKS
        },
    }
    out = Path(args.results_dir)
    (out / f"{args.name}.json").write_text(json.dumps(record, indent=2) + "\n")
    write_markdown(out / f"{args.name}.md", record)
    print((out / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
