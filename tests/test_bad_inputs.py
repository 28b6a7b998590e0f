"""Every bad input through the real CLI (`./run_train.sh`, a subprocess each): exit 2, one line
that names the field or file, no traceback, no torchrun failure report.

Most cases stop in the pre-launch check. Those run in one Python process
(tests/bad_input_worker.py: the same `trainer.launch --check-config` call `run_train.sh` makes,
stdout and stderr captured per case), except a few sent through `./run_train.sh` itself
(`VIA_CLI`) to keep the shell path honest; the ones the shell finds (NGPU, NPROC, LOG_RANK)
and the ones only a worker can find (data content, checkpoint bytes, HF weights, a diverging
run) go through `./run_train.sh`, the latter through torchrun with the tiny model (~10 s).
Subprocesses run two at a time. The table at the top is the list of bad inputs covered;
`python -m pytest -q -s tests/test_bad_inputs.py` prints each case's line.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import REPO, TINY, run_in_process, run_killing_group

# (name, env, argv, fragment the one line must contain). "{d}" is a folder of prepared inputs.
PRE_LAUNCH = [
    # config: keys, types, ranges
    ("unknown key", {}, ["--training.stpes", "3"], "training.stpes"),
    ("unknown section", {}, ["--trainig.steps", "3"], "--training.steps"),
    ("int not a number", {}, ["--training.steps", "abc"], "training.steps"),
    ("int below min", {}, ["--training.steps", "0"], "training.steps"),
    ("float nan", {}, ["--optimizer.lr", "nan"], "optimizer.lr"),
    ("float inf", {}, ["--training.max_norm", "inf"], "training.max_norm"),
    ("float overflow", {}, ["--optimizer.beta2", "1e999"], "optimizer.beta2"),
    ("bool garbage", {}, ["--checkpoint.enable", "maybe"], "checkpoint.enable"),
    ("bad choice", {}, ["--activation_checkpoint.mode", "opp"], "activation_checkpoint.mode"),
    ("unknown model", {}, ["--model.name", "lama3"], "model.name"),
    ("unknown flavor", {}, ["--model.flavor", "8b"], "model.flavor"),
    ("missing config file", {}, ["--config", "llama9b.toml"], "llama9b.toml"),
    ("positional argument", {}, ["steps"], "unexpected argument"),
    ("seq_len above the model's", {}, ["--training.seq_len", "99999999"], "training.seq_len"),
    ("unknown compile backend", {}, ["--compile.backend", "inductr"], "compile.backend"),
    ("unknown optimizer", {}, ["--optimizer.name", "sgd"], "optimizer.name"),
    ("context parallel chunks", {"NGPU": "2"}, ["--parallelism.context_parallel_degree", "2",
                                                "--training.seq_len", "66"], "context_parallel_degree"),
    # config: TOML files
    ("TOML syntax", {}, ["--config", "{d}/syntax.toml"], "syntax.toml"),
    ("TOML unknown section", {}, ["--config", "{d}/section.toml"], "[trainig]"),
    ("TOML wrong type", {}, ["--config", "{d}/type.toml"], "training.steps"),
    ("TOML nan", {}, ["--config", "{d}/nan.toml"], "optimizer.lr"),
    # options that need another one
    ("data files without a path", {}, ["--data.type", "files"], "data.path"),
    ("data path the source type ignores", {}, ["--data.path", "{d}/small.txt"], "data.path"),
    ("CPU offload without FSDP", {}, ["--parallelism.fsdp_cpu_offload", "true"], "parallelism.fsdp_cpu_offload"),
    ("load_step without checkpoints", {}, ["--checkpoint.load_step", "3"], "checkpoint.load_step"),
    ("model-only export without checkpoints", {}, ["--checkpoint.last_save_model_only", "true"],
     "checkpoint.last_save_model_only"),
    ("seed checkpoint without checkpoints", {}, ["--checkpoint.create_seed_checkpoint", "true"],
     "checkpoint.create_seed_checkpoint"),
    ("initial_load_in_hf without a path", {}, ["--checkpoint.initial_load_in_hf", "true"],
     "checkpoint.initial_load_path"),
    ("load_step not there", {}, ["--checkpoint.enable", "true", "--checkpoint.folder", "{d}/ck_good",
                                 "--checkpoint.load_step", "7"], "checkpoint.load_step"),
    # layout against the world size
    ("tp does not divide the world", {"NGPU": "4"}, ["--parallelism.tensor_parallel_degree", "8"], "tp(8)"),
    ("tp does not divide the heads", {"NGPU": "3"}, ["--parallelism.tensor_parallel_degree", "3"],
     "tensor_parallel_degree"),
    ("more stages than layers", {"NGPU": "8"}, TINY[:2] + ["--parallelism.pipeline_parallel_degree", "8"],
     "pipeline_parallel_degree"),
    ("global batch not a multiple", {"NGPU": "2"}, ["--training.global_batch_size", "12",
                                                   "--training.local_batch_size", "8"], "training.global_batch_size"),
    ("ep does not divide", {"NGPU": "2"}, ["--config", "deepseek_debug.toml",
                                           "--parallelism.expert_parallel_degree", "3"], "expert_parallel_degree"),
    ("microbatches vs pipeline", {"NGPU": "2"}, ["--parallelism.pipeline_parallel_degree", "2",
                                                 "--training.local_batch_size", "3",
                                                 "--parallelism.pipeline_parallel_microbatch_size", "2"],
     "training.local_batch_size"),
    ("dry run on a layout that does not fit", {"NGPU": "3"}, ["--config", "llama70b.toml", "--dry-run"], "tp(8)"),
    # run_train.sh's environment
    ("NGPU not a number", {"NGPU": "abc"}, [], "NGPU"),
    ("NGPU zero", {"NGPU": "0"}, [], "NGPU"),
    ("NPROC fractional", {"NPROC": "1.5"}, [], "NPROC"),
    ("LOG_RANK beyond the ranks", {"LOG_RANK": "5"}, [], "LOG_RANK"),
    ("LOG_RANK not a rank", {"LOG_RANK": "a"}, [], "LOG_RANK"),
    # files and devices found before any worker starts
    ("tokenizer missing", {}, ["--model.tokenizer_path", "{d}/nope.model"], "model.tokenizer_path"),
    ("tokenizer garbage", {}, ["--model.tokenizer_path", "{d}/garbage.model"], "garbage.model"),
    ("initial_load_path missing", {}, ["--checkpoint.initial_load_path", "{d}/nope"], "checkpoint.initial_load_path"),
    ("initial_load_path not DCP", {}, ["--checkpoint.initial_load_path", "{d}"], "checkpoint.initial_load_path"),
    ("dump folder not writable", {}, ["--job.dump_folder", "{d}/a_file/out"], "job.dump_folder"),
    ("checkpoint folder not writable", {}, ["--checkpoint.enable", "true", "--checkpoint.folder",
                                            "{d}/a_file/ck"], "checkpoint.folder"),
    ("GPU requested, none here", {}, ["--training.device", "cuda"], "training.device"),
    ("token folder with other BOS/EOS ids", {}, ["--data.type", "tokens", "--data.path", "{d}/tok_other_ids"],
     "tok_other_ids was tokenized with BOS/EOS ids"),
    # checkpoints whose damage shows in names and sizes
    ("truncated .distcp", {}, TINY + ["--checkpoint.enable", "true", "--checkpoint.folder", "{d}/ck_truncated"],
     "ck_truncated/step-2"),
    ("empty .distcp", {}, TINY + ["--checkpoint.enable", "true", "--checkpoint.folder", "{d}/ck_empty"],
     "ck_empty/step-2"),
    ("deleted .distcp", {}, TINY + ["--checkpoint.enable", "true", "--checkpoint.folder", "{d}/ck_deleted"],
     "ck_deleted/step-2"),
    ("missing .metadata", {}, TINY + ["--checkpoint.enable", "true", "--checkpoint.folder", "{d}/ck_nometa"],
     "ck_nometa/step-2"),
]

# Found by a worker: through torchrun, reported by trainer.launch as the worker's one line.
IN_WORKER = [
    ("dataset path missing", {}, TINY + ["--data.type", "files", "--data.path", "{d}/nope.txt"],
     "nope.txt"),
    ("dataset empty", {}, TINY + ["--data.type", "files", "--data.path", "{d}/empty.txt"],
     "empty.txt"),
    ("dataset too small for one batch", {"NGPU": "2", "LOG_RANK": "1"},
     TINY + ["--data.type", "files", "--data.path", "{d}/small.txt"], "training.seq_len"),
    ("dataset line not JSON", {}, TINY + ["--data.type", "files", "--data.path", "{d}/bad.jsonl"],
     "bad.jsonl:2"),
    ("flipped byte in a tensor", {}, TINY + ["--checkpoint.enable", "true", "--checkpoint.folder", "{d}/ck_flipped"],
     "ck_flipped/step-2"),
    ("another flavor's checkpoint", {}, TINY + ["--model.flavor", "debug", "--checkpoint.enable", "true",
                                                "--checkpoint.folder", "{d}/ck_good"], "another model or flavor"),
    ("learning rate that diverges", {}, TINY + ["--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "1",
                                                "--training.steps", "10"], "training.max_skipped_steps"),
    ("HF folder without weights", {}, TINY + ["--checkpoint.initial_load_path", "{d}/hf_empty",
                                              "--checkpoint.initial_load_in_hf", "true"], "hf_empty"),
    ("Muon rule that matches no parameter", {}, TINY + ["--optimizer.name", "muon", "--optimizer.muon_params",
                                                        "layers.*,blocks.*"], "optimizer.muon_params: 'blocks.*'"),
]


# Pre-launch cases that also go through `./run_train.sh` (one per kind of input), and those
# only the shell checks: the rest run their pre-launch check in one process.
VIA_CLI = {"unknown key", "TOML syntax", "dry run on a layout that does not fit", "tokenizer missing",
           "truncated .distcp", "NGPU not a number", "NGPU zero", "NPROC fractional", "LOG_RANK beyond the ranks",
           "LOG_RANK not a rank"}


class _Result:
    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _run_batched(cases, d: Path, tmp: Path) -> list[tuple]:
    """The pre-launch check of `cases` in one process (tests/bad_input_worker.py)."""
    specs = []
    for i, (name, env, argv, fragment) in enumerate(cases):
        assert set(env) <= {"NGPU"}, name  # the shell's own variables need the shell
        argv = [a.replace("{d}", str(d)) for a in argv]
        if not any(a == "--job.dump_folder" for a in argv):
            argv += ["--job.dump_folder", str(tmp / f"batched{i}")]
        specs.append({"argv": argv, "ngpu": env.get("NGPU", "1")})
    path = tmp / "batched_cases.json"
    path.write_text(json.dumps(specs))
    t0 = time.time()
    proc = run_killing_group([sys.executable, "-m", "tests.bad_input_worker", str(path)], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    secs = (time.time() - t0) / len(cases)
    return [(case, _Result(r["rc"], r["stdout"], r["stderr"]), secs, case[3].replace("{d}", str(d)))
            for case, r in zip(cases, got)]


def _prepare(d: Path) -> None:
    (d / "syntax.toml").write_text("[training\nsteps = 3\n")
    (d / "section.toml").write_text("[trainig]\nsteps = 3\n")
    (d / "type.toml").write_text('[training]\nsteps = "ten"\n')
    (d / "nan.toml").write_text("[optimizer]\nlr = nan\n")
    (d / "garbage.model").write_text("this is not a tokenizer\n")
    (d / "a_file").write_text("a file where a folder is expected\n")
    (d / "empty.txt").write_text("")
    (d / "small.txt").write_text("hi there\n")
    (d / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    (d / "hf_empty").mkdir()
    import json

    from trainer.config import DEFAULT_TOKENIZER
    from trainer.data.pretokenize import tokenize_to_shards

    (d / "doc.jsonl").write_text(json.dumps({"text": "a document " * 20}) + "\n")
    tokenize_to_shards([str(d / "doc.jsonl")], str(d / "tok_other_ids"), DEFAULT_TOKENIZER,
                       progress_bar=False)
    manifest = json.loads((d / "tok_other_ids" / "manifest.json").read_text())
    manifest["tokenizer"]["bos_id"] += 1  # as another tokenizer config's special ids would
    (d / "tok_other_ids" / "manifest.json").write_text(json.dumps(manifest))
    # One real checkpoint of the tiny model (step 2), then damaged copies.
    run_in_process(TINY + ["--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "2",
                           "--checkpoint.folder", str(d / "ck_good"), "--job.dump_folder", str(d / "run")])
    good = d / "ck_good" / "step-2"
    shard = next(good.glob("__0_*.distcp"))

    def damaged(name: str, damage) -> None:
        shutil.copytree(d / "ck_good", d / name)
        damage(d / name / "step-2" / shard.name)

    damaged("ck_truncated", lambda p: os.truncate(p, p.stat().st_size // 2))
    damaged("ck_empty", lambda p: os.truncate(p, 0))
    damaged("ck_deleted", lambda p: p.unlink())
    damaged("ck_nometa", lambda p: (p.parent / ".metadata").unlink() or (p.parent / "manifest.json").unlink())

    def flip(p: Path) -> None:  # one bit in the middle of the file: inside a tensor's bytes
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0x10
        p.write_bytes(bytes(data))

    damaged("ck_flipped", flip)


def _run(case, d: Path, dump: Path) -> tuple:
    name, env, argv, fragment = case
    argv = [a.replace("{d}", str(d)) for a in argv]
    if not any(a == "--job.dump_folder" for a in argv):
        argv += ["--job.dump_folder", str(dump)]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "NGPU": "1", **env}
    if "NPROC" in env:
        full_env.pop("NGPU")
    t0 = time.time()
    proc = run_killing_group(["./run_train.sh", *argv], cwd=REPO, env=full_env, timeout=240)
    return case, proc, time.time() - t0, fragment.replace("{d}", str(d))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_bad_input_is_one_line_exit_2_no_traceback(tmp_path):
    d = tmp_path / "inputs"
    d.mkdir()
    _prepare(d)
    assert len(IN_WORKER + PRE_LAUNCH) >= 40
    assert VIA_CLI <= {c[0] for c in PRE_LAUNCH}
    via_cli = IN_WORKER + [c for c in PRE_LAUNCH if c[0] in VIA_CLI]  # the slow ones first
    with ThreadPoolExecutor(max_workers=2) as pool:
        batched = pool.submit(_run_batched, [c for c in PRE_LAUNCH if c[0] not in VIA_CLI], d, tmp_path)
        results = list(pool.map(lambda ic: _run(ic[1], d, tmp_path / f"dump{ic[0]}"), enumerate(via_cli)))
        results += batched.result()
    problems = []
    for (name, env, argv, _), proc, secs, fragment in results:
        out = proc.stdout + proc.stderr
        lines = [ln for ln in proc.stderr.splitlines() if fragment in ln]
        print(f"{secs:5.1f}s rc={proc.returncode} {name}: {lines[0] if lines else proc.stderr.strip()[-300:]}")
        why = []
        if proc.returncode != 2:
            why.append(f"exit code {proc.returncode}")
        if "Traceback" in out or "ChildFailedError" in out:
            why.append("a traceback or launcher report")
        if len(lines) != 1:
            why.append(f"{len(lines)} stderr lines name {fragment!r}")
        if why:
            problems.append(f"{name} ({', '.join(why)}):\n{out[-2500:]}")
    assert not problems, "\n\n".join(problems)


def test_unwritable_folder_is_named_before_step_1(tmp_path, monkeypatch):
    """A path through a file, and a folder the OS refuses (EACCES, as a read-only mount or
    another user's folder gives it; simulated, since CI runs as root)."""
    import errno

    from configuration.fields import ConfigError
    from trainer.errors import check_writable_folder

    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"job.dump_folder: .*/f/out is not writable"):
        check_writable_folder(tmp_path / "f" / "out", "job.dump_folder")

    def refuse(path, *a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(os, "makedirs", refuse)
    with pytest.raises(ConfigError, match=r"checkpoint.folder: .*/ro/out is not writable: permission denied"):
        check_writable_folder(tmp_path / "ro" / "out", "checkpoint.folder")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="as root, file permissions do not stop writes (the EACCES path is tested above)")
def test_read_only_folder_is_refused_by_the_os(tmp_path):
    from configuration.fields import ConfigError
    from trainer.errors import check_writable_folder

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(ConfigError, match="(?i)permission denied"):
            check_writable_folder(ro / "out", "checkpoint.folder")
    finally:
        ro.chmod(stat.S_IRWXU)
