"""Each command-line flag is defined once: a flag several scripts share (--out, --seed, --resume,
--dtype, ...) is added by one function (srt/config.py, srt/run.py, srt/precision.py, srt/recall.py,
reward.py), which fixes its type, range and action; a script may word its help. Checked over the
scripts and the package; bench/'s measurements keep flags of their own."""

import ast
import importlib
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted([*REPO.glob("*.py"), *(REPO / "srt").rglob("*.py")])

# Every flag each script offers (its build_parser; parse_config adds --preset to some).
OFFERED = {
    "stage0_build": "--source --path --input --limit --queries --locomo-adversarial --locomo-window "
    "--locomo-train-unsupported --num-dialogues --out --seed --teacher --teacher-cache "
    "--teacher-max-new-tokens --api-base --api-key-env --max-concurrency --api-timeout --api-retries "
    "--device --trust-remote-code --min-rounds --max-rounds --w-sem --w-dist --decay --threshold "
    "--dedup-intent --dedup-jaccard --dev-fraction --test-fraction --split --on-error --resume "
    "--overwrite --quiet",
    "stage1_sft": "--model --data --out --seed --resume --overwrite --max-steps --time-budget-minutes "
    "--trust-remote-code --phase --phase1-fraction --epochs --lr --warmup-steps --weight-decay "
    "--max-grad-norm --max-length --batch-size --grad-accum --target --no-cot --recall --dtype "
    "--gradient-checkpointing --no-gradient-checkpointing --attention --save-every --snapshot-every "
    "--log-every --eval-data --eval-limit --eval-max-new-tokens --fsdp --dist-timeout-minutes --dry-run "
    "--world-size --gpu-memory-gb",
    "stage2_grpo": "--model --data --out --seed --resume --overwrite --max-steps --time-budget-minutes "
    "--explain --explain-tries --explain-html --num-generations --prompts-per-step --sample-ratio --mu "
    "--lr --warmup-steps --weight-decay --max-grad-norm --beta --clip-eps --temperature --top-p "
    "--max-new-tokens --max-prompt-length --answer-reward --answer-gate --dynamic-sampling --max-draws "
    "--train-turns --credit --loss-type --scale-rewards --importance-sampling-level --gspo-clip-eps "
    "--clip-higher --is-mode --is-cap --recall --placebo --dtype "
    "--gradient-checkpointing --no-gradient-checkpointing --micro-batch-size --share-prompts "
    "--no-share-prompts --save-every --sample-every --eval-data --eval-limit --eval-max-new-tokens "
    "--probe-every --eval-batch-size --fsdp --dist-timeout-minutes --dry-run --world-size --gpu-memory-gb",
    "evaluate": "--method --model --data --out --compare --variant-options --pairs --table2 --limit "
    "--buckets --batch-size --latency-per-bucket --max-new-tokens --max-new-tokens-direct --recall "
    "--recency-k --rag-k --conversations --max-prompt-tokens --cuemem-options --cuemem-extractor "
    "--cuemem-extractor-model --cuemem-api-base --cuemem-api-model --answer-reward --bootstrap "
    "--runs-spread --attention-examples --api-base --api-model --api-key-env --dtype --device --seed "
    "--resume --overwrite --quiet",
    "reward": "--gallery --markdown --reward --data --index --id --completion --completions "
    "--answer-reward --answer-gate --out --overwrite",
    "cuemem": "--data --model --out --limit --seed --resume --overwrite --retrieval-only --compare-full "
    "--extractor --extractor-model --api-base --api-model --api-key-env --top-k --window --links-per-cue "
    "--link-threshold --max-evidence --temporal-decay --min-relative-score --no-graph --no-priority "
    "--capacity --max-age --max-new-tokens --dtype --device",
    "srt.exercises": "--out --grade --list --time-limit",
    "srt.runs_report": "--srt --control --base --out --judge-against",
}


def flag_definitions(path: Path) -> list[tuple[str, int]]:
    """(flag, line) of every add_argument call in `path` whose first argument names a flag, called
    as X.add_argument(...) or through a name bound to one (add = group.add_argument)."""
    tree = ast.parse(path.read_text())
    aliases = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "add_argument"
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        func = node.func
        adds = (isinstance(func, ast.Attribute) and func.attr == "add_argument") or (
            isinstance(func, ast.Name) and func.id in aliases
        )
        first = node.args[0]
        if adds and isinstance(first, ast.Constant) and str(first.value).startswith("--"):
            found.append((first.value, node.lineno))
    return found


def test_every_flag_name_is_defined_in_one_place():
    places = defaultdict(list)
    for path in SOURCES:
        for flag, line in flag_definitions(path):
            places[flag].append(f"{path.relative_to(REPO).as_posix()}:{line}")
    assert len(places) > 100  # the scan sees the scripts' flags
    twice = {flag: where for flag, where in places.items() if len(where) > 1}
    assert twice == {}


def test_the_scan_sees_a_flag_added_through_an_alias(tmp_path):
    source = tmp_path / "x.py"
    source.write_text('add = group.add_argument\nadd("--lr", type=float)\nparser.add_argument("--out")\n')
    assert flag_definitions(source) == [("--lr", 2), ("--out", 3)]


@pytest.mark.parametrize("script", sorted(OFFERED))
def test_every_script_still_offers_its_flags(script):
    parser = importlib.import_module(script).build_parser()
    offered = {option for action in parser._actions for option in action.option_strings}
    assert set(OFFERED[script].split()) <= offered
