"""README.md stays true: its config reference is the one the code generates, and every command
it shows works as written (or, where CPU CI cannot run it, is listed with the reason)."""

import re
import subprocess
import sys

import pytest

from tests.helpers import REPO


def test_readme_config_reference_is_current():
    generated = subprocess.run([sys.executable, "scripts/config_reference.py"], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout.strip()
    readme = (REPO / "README.md").read_text()
    block = re.search(r"<!-- config-reference:start -->\n(.*)\n<!-- config-reference:end -->", readme, re.S)
    assert block, "README.md lost its config-reference markers"
    assert block.group(1).strip() == generated, "run: python scripts/config_reference.py and paste into README.md"


def test_readme_gives_the_two_commands():
    readme = (REPO / "README.md").read_text()
    assert "./run_train.sh" in readme and "python -m pytest -q" in readme
    ci = (REPO / ".ci" / "run").read_text()
    assert "python -m pytest -q" in ci


# ---------------------------------------------------------------------------- the README's commands
# Every command the README shows, and how the test runs it. A command added to the README
# without an entry here fails `test_every_readme_command_is_classified`, so the README
# cannot drift from what works. Modes:
#   run     exactly as written (plus a --job.dump_folder in a temporary folder for training)
#   steps   as written plus --training.steps 2: a real launch of that config and layout
#   dry     as written plus --dry-run: configs too big to train here; the layout is still
#           checked against the world size the command gives (NGPU) or the config implies
#   expect  as written; must print the README's output line and exit 2 (an error example)
#   skip    needs what CPU CI has not (weights on disk, a cluster) or is CI itself; the reason
#           names the test that covers it
_NEEDS_HF = "needs published weights under /models; tests/test_hf_train.py and tests/test_hf_scripts.py"
README_COMMANDS = {
    "pip install torch==2.13.0 && pip install -e '.[dev]'": ("skip", "CI's install step (.ci/run)"),
    "pip install -e '.[float8]'": ("skip", "torchao is in the dev extra CI installs; tests/test_float8.py"),
    "pip install -e '.[ft]'": ("skip", "torchft is in the dev extra CI installs; tests/test_fault_tolerance.py"),
    "./run_train.sh --fault_tolerance.enable": ("steps", ""),
    "FT_GROUPS=4 sbatch --nodes=4 scripts/ft_trainer.slurm --checkpoint.enable true":
        ("skip", "needs a SLURM cluster; tests/test_slurm_ft.py runs the script on the local one"),
    "./run_train.sh": ("steps", ""),
    "python -m pytest -q": ("skip", "what CI runs"),
    "./run_train.sh --config llama8b.toml": ("dry", ""),
    "./run_train.sh --config llama8b.toml --dry-run": ("run", ""),
    "./run_train.sh --training.steps 20 --optimizer.lr 1e-3": ("run", ""),
    "NGPU=8 ./run_train.sh --config llama_debug_3d.toml": ("dry", ""),
    "LOG_RANK=0,1 NGPU=2 ./run_train.sh": ("steps", ""),
    "python -m trainer.train --help": ("run", ""),
    "./run_train.sh --training.stpes 3": ("expect", ""),
    "./run_train.sh --config deepseek_debug.toml": ("steps", ""),
    "python scripts/tokenize_data.py --input /data/fineweb/ --output /data/fineweb-tok --workers 16":
        ("skip", "needs a corpus under /data; tests/test_data*.py tokenize generated files"),
    "./run_train.sh --config llama8b.toml --data.path /data/fineweb-tok": ("skip", "needs a tokenized corpus under /data"),
    "python scripts/bench_activation_checkpoint.py --config llama_debug.toml --steps 1 --threads 1 --interleaved 8":
        ("skip", "a benchmark (minutes); its modes are tested in tests/test_activation_checkpoint.py"),
    "python scripts/bench_data.py": ("skip", "a benchmark; the data path is tested in tests/test_data*.py"),
    "./run_train.sh --config deepseek_v3_671b.toml --dry-run": ("run", ""),
    "python scripts/plan.py --config llama8b.toml --gpus 8 --gpu h100-sxm --seq-len 8192 --global-batch-tokens 131072":
        ("skip", "a search over the 8B model (minutes on 2 cores); tests/test_planner.py runs a small search end "
                 "to end"),
    "python scripts/plan.py --calibrate": ("skip", "measures this machine (a benchmark); the planner's CPU path is "
                                                   "tested in tests/test_planner.py"),
    # Starting from published weights: every command needs an HF folder under /models.
    "./run_train.sh --config llama8b_from_hf.toml": ("skip", _NEEDS_HF),
    "./run_train.sh --config deepseek_v3_671b.toml --model.hf_path /models/DeepSeek-V3 --model.mtp_depth 1":
        ("skip", _NEEDS_HF),
    "./run_train.sh --model.hf_path /models/DeepSeek-V3 --model.name llama3": ("skip", _NEEDS_HF),
    "./run_train.sh --config llama8b_from_hf.toml --checkpoint.last_save_in_hf true": ("skip", _NEEDS_HF),
    "python scripts/convert_checkpoint.py dcp-to-hf outputs/llama8b_from_hf/checkpoint/step-1000 /tmp/hf_out "
    "--model.hf_path /models/Llama-3.1-8B": ("skip", _NEEDS_HF),
    "python scripts/convert_checkpoint.py hf-to-dcp /models/Llama-3.1-8B /tmp/dcp_in": ("skip", _NEEDS_HF),
    'python scripts/generate.py --model.hf_path /models/Llama-3.1-8B --prompt "The meaning of" --top_k 50':
        ("skip", _NEEDS_HF),
    'python scripts/generate.py --checkpoint /tmp/hf_out --prompt "The meaning of" --temperature 0':
        ("skip", _NEEDS_HF),
    "./run_train.sh --model.hf_path": ("skip", _NEEDS_HF),
    "CONFIG_FILE=train_configs/llama8b.toml sbatch --nodes=4 scripts/multinode_trainer.slurm "
    "--checkpoint.enable true --job.dump_folder /shared/runs/llama8b": ("skip", "needs SLURM; tests/test_slurm.py"),
    "python -m pytest -q -s tests/test_parallel_layouts.py": ("skip", "part of the suite"),
    "python -m pytest -q -s tests/test_expert_parallel.py": ("skip", "part of the suite"),
    "python -m pytest -q -s tests/test_context_parallel_train.py": ("skip", "part of the suite"),
    "python -m pytest -q -s tests/test_feature_matrix.py": ("skip", "part of the suite"),
    "python scripts/estimate_memory.py --config llama8b.toml": ("run", ""),
    "python scripts/estimate_memory.py --config llama8b.toml --table": ("run", ""),
    "python -m trainer.launch": ("skip", "the launcher alone, without a worker command; tests/test_launch_errors.py"),
    "scancel --signal=USR1 <job>": ("skip", "needs SLURM; tests/test_slurm.py"),
    "python scripts/config_reference.py": ("run", ""),
}
COMMAND_START = re.compile(r"^(\$ )?((?:[A-Z_]+=\S+ )*)(\./run_train\.sh|python |pip |sbatch |scancel )")


def readme_commands() -> list[tuple[str, str | None]]:
    """(command, the output line the README shows after it, if any), from code blocks and
    inline code; `\\` continuations joined, comments dropped."""
    text = (REPO / "README.md").read_text()
    found: list[tuple[str, str | None]] = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S):
        lines = block.replace("\\\n", " ").splitlines()
        for i, line in enumerate(lines):
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line.startswith("#") or not COMMAND_START.match(line):
                continue
            shown = lines[i + 1].strip() if line.startswith("$ ") and i + 1 < len(lines) else None
            found.append((" ".join(line.removeprefix("$ ").split()), shown))
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", prose):
        if COMMAND_START.match(span) and span not in [c for c, _ in found]:
            found.append((span, None))
    return found


def test_every_readme_command_is_classified():
    commands = [c for c, _ in readme_commands()]
    missing = [c for c in commands if c not in README_COMMANDS]
    stale = [c for c in README_COMMANDS if c not in commands]
    assert not missing, f"README commands without an entry in README_COMMANDS: {missing}"
    assert not stale, f"README_COMMANDS entries no longer in the README: {stale}"


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_readme_command_that_can_run_on_cpu_works(tmp_path):
    """Two commands at a time; a command that runs exactly like another (`dry` of X is
    `X --dry-run`) runs once and both are judged on that run."""
    import os
    import shlex
    from concurrent.futures import ThreadPoolExecutor

    from tests.helpers import run_killing_group

    planned, runs = [], {}
    for i, (command, shown) in enumerate(readme_commands()):
        mode, _ = README_COMMANDS[command]
        if mode == "skip":
            continue
        words = shlex.split(command)
        env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        while "=" in words[0] and not words[0].startswith("-"):
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        if words[0] == "python":
            words[0] = sys.executable
        words += {"steps": ["--training.steps", "2"], "dry": ["--dry-run"]}.get(mode, [])
        key = (tuple(words), tuple(sorted(env.items())))
        if words[0] == "./run_train.sh" and mode != "expect" and key not in runs:
            runs[key] = words + ["--job.dump_folder", str(tmp_path / f"run{i}")]
        runs.setdefault(key, words)
        planned.append((command, shown, mode, key))

    def run(key):
        return key, run_killing_group(runs[key], cwd=REPO, env={**os.environ, **dict(key[1])}, timeout=600)

    with ThreadPoolExecutor(max_workers=2) as pool:
        done = dict(pool.map(run, list(runs)))
    assert len(runs) < len(planned)  # at least one run serves two commands
    problems = []
    for command, shown, mode, key in planned:
        proc = done[key]
        out = proc.stdout + proc.stderr
        if mode == "expect":
            ok = proc.returncode == 2 and shown in proc.stderr.splitlines()
        else:
            ok = proc.returncode == 0 and "Traceback" not in out
        if not ok:
            problems.append(f"{command!r} ({mode}): exit {proc.returncode}\n{out[-2000:]}")
    assert not problems, "\n\n".join(problems)
