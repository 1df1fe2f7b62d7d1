"""moe_gemm.tuning.cli's device resolution on the CPU (torch.cuda's answers stood in)."""

from __future__ import annotations

import pytest
import torch

from moe_gemm import capability
from moe_gemm.tuning import cli


@pytest.fixture
def two_gpus(monkeypatch):
    """Two CUDA GPUs our kernels run on, the second current; records set_device's argument."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(capability, "cute_problem", lambda device: None)
    return chosen


def test_plain_cuda_names_the_current_gpu_with_its_index(two_gpus):
    # torch.cuda.set_device(torch.device("cuda")) raises: the tuner's A/B (--configs) did.
    device, why = cli.kernel_device("cuda")
    assert why is None and device == torch.device("cuda", 1)
    assert two_gpus == [torch.device("cuda", 1)] and two_gpus[0].index == 1


def test_an_indexed_gpu_is_kept(two_gpus):
    device, why = cli.kernel_device("cuda:0")
    assert why is None and device.index == 0 and two_gpus == [device]


@pytest.mark.parametrize("spec, words", [("cuda:5", "has 2 GPU"), ("cpu", "needs a CUDA GPU"),
                                         ("gpu", "is not a device")])
def test_a_device_that_cannot_run_says_why(two_gpus, spec, words):
    device, why = cli.kernel_device(spec)
    assert device is None and words in why and two_gpus == []


def test_a_gpu_our_kernels_refuse_says_why(two_gpus, monkeypatch):
    monkeypatch.setattr(capability, "cute_problem", lambda device: "sm_80 is not sm_90a")
    device, why = cli.kernel_device("cuda")
    assert device is None and "sm_80 is not sm_90a" in why and two_gpus == []


def test_no_cuda_at_all(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.kernel_device("cuda") == (None, "needs a CUDA GPU (use --list without one)")


@pytest.mark.parametrize("text", ["-1", "nan", "inf", "soon"])
def test_rest_ms_must_be_a_finite_non_negative_number(text, capsys):
    with pytest.raises(SystemExit) as exc:
        cli._parser().parse_args(["--zoo", "--rest-ms", text])
    assert exc.value.code == 2
    assert "--rest-ms: expected a finite number of milliseconds >= 0" in capsys.readouterr().err


def test_rest_ms_defaults_to_the_tuners_rest():
    from moe_gemm.tuning.timing import REST_MS

    assert cli.parse_args(["--zoo"]).rest_ms == REST_MS
    assert cli._parser().parse_args(["--zoo", "--rest-ms", "0"]).rest_ms == 0.0


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "x"])
def test_sample_ms_must_be_a_positive_finite_number(text, capsys):
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["--zoo", "--sample-ms", text])
    # (the bound of --sample-ms, not of --rest-ms whose parser it shares)
    assert "--sample-ms: expected a finite number of milliseconds > 0" in capsys.readouterr().err


def test_sample_ms_defaults_to_the_tuners_target():
    from moe_gemm.tuning.timing import TARGET_MS

    assert cli.parse_args(["--zoo"]).sample_ms == TARGET_MS
    assert cli._parser().parse_args(["--zoo", "--sample-ms", "5"]).sample_ms == 5.0


def test_timing_defaults_to_graphs_and_takes_eager(capsys):
    assert cli.parse_args(["--zoo"]).timing == "graph"
    assert cli._parser().parse_args(["--zoo", "--timing", "eager"]).timing == "eager"
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["--zoo", "--timing", "burst"])
    assert "invalid choice: 'burst'" in capsys.readouterr().err


@pytest.mark.parametrize("config,words", [
    ("coop 128x200", "tile 128x200 is not built for schedule 'cooperative'"),
    ("pp 128x256", "tile 128x256 is not built for schedule 'pingpong'"),
    ("coop 128x256 c2x2", "cluster 2x2 is not supported"),
    ("coop 128x256 s99", "stages must be between 2 and 12"),
    ("coop 128x256 p0", "cannot read 'p0' (expected a positive count)"),
    ("coop 128x256 ts host", "tail_split=True is built for the device visitor"),
    ("coop 128x256 ksort", "'host' and 'ksort' are for --form general"),
    ("pp 128x192 host", "'host' and 'ksort' are for --form general"),
])
def test_configs_no_shape_can_run_are_refused_at_once(config, words, capsys):
    # They parsed, and each came back as an error on every shape of the A/B only after the
    # GPU work had started; no --list, no GPU is needed to refuse them.
    assert cli.main(["--shapes", "8,512,256,64", "--configs", f"pp 128x192;{config}",
                     "--list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moe-gemm tune: config {config!r}: ") and words in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("config,options,words", [
    ("coop 128x256 ew", ["--out-dtype", "fp32"], "'ew' is for 16-bit output"),
    ("coop 128x256 s6", [], "6 A/B stages do not fit in shared memory"),
    ("pp 128x208 s5", ["--out-dtype", "fp32"], "5 A/B stages do not fit in shared memory"),
])
def test_configs_the_dtypes_cannot_build_are_refused_at_once(config, options, words, capsys):
    # GemmConfig takes them, the kernel does not (whole-tile epilogue on an fp32 output,
    # stages past shared memory): they came back as an error on every shape of the A/B.
    assert cli.main(["--shapes", "8,512,256,64", *options, "--configs",
                     f"pp 128x192;{config}", "--list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moe-gemm tune: config {config!r}: ") and words in err
    # The same configs where they build.
    assert cli.main(["--shapes", "8,512,256,64", "--configs", "coop 128x256 ew;coop 128x256 "
                     "s4;pp 128x208 s5", "--out-dtype", "bf16", "--list"]) == 0


@pytest.mark.parametrize("options,words", [
    (["--form", "batched"], "'swap' tiles are for --form varlen"),
    (["--form", "general"], "'swap' tiles are for --form varlen"),
    (["--out-dtype", "fp32"], "'swap' tiles store 16-bit output"),
])
def test_swapped_configs_outside_their_form_are_refused_at_once(options, words, capsys):
    # grouped_mm refuses them at run time (other forms, a 32-bit output): accepted by the
    # A/B, each shape failed after the GPU work had started.
    assert cli.main(["--shapes", "8,512,256,64", *options, "--configs", "swap 256x128",
                     "--list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-gemm tune: config 'swap 256x128': ") and words in err
    assert cli.main(["--shapes", "8,512,256,64", "--configs", "swap 256x128", "--list"]) == 0


def test_general_configs_take_host_ksort_and_the_tail_split(capsys):
    assert cli.main(["--shapes", "8,512,256,64", "--form", "general", "--configs",
                     "coop 128x256 host ksort", "--list"]) == 0
    assert cli.main(["--shapes", "8,512,256,64", "--form", "general", "--configs",
                     "coop 128x256 ts", "--list"]) == 0
    capsys.readouterr()
    # (the split is built for the device visitor: with the host one it is refused)
    assert cli.main(["--shapes", "8,512,256,64", "--form", "general", "--configs",
                     "coop 128x256 host ts", "--list"]) == 2
    assert "device visitor" in capsys.readouterr().err


@pytest.mark.parametrize("option", [["--models", "Mixtral-8x7B"], ["--tokens", "16"],
                                    ["--models", "no-such-model"]])
def test_zoo_options_without_zoo_are_refused(option, capsys):
    # They select among the zoo's shapes; without --zoo the run tuned --shapes alone.
    assert cli.main(["--shapes", "8,512,256,64", *option, "--list"]) == 2
    assert capsys.readouterr().err == (
        "moe-gemm tune: --models and --tokens choose the zoo's shapes: add --zoo\n")


@pytest.mark.parametrize("workers", ["0", "-3"])
def test_workers_must_be_positive(workers, capsys):
    # 0 was read as the default count and a negative one as a single process, silently.
    assert cli.main(["--shapes", "8,512,256,64", "--workers", workers]) == 2
    assert capsys.readouterr().err.startswith(f"moe-gemm tune: --workers {workers}: must be >= 1")


@pytest.mark.parametrize("argv, words", [
    (["--form", "batched"], "--form batched is for --shapes; the zoo's shapes are varlen"),
    (["--form", "general"], "--form general is for --shapes; the zoo's shapes are varlen"),
    (["--form", "batched", "--shapes", "8,512,256,64", "--configs", "coop 128x256"],
     "and --configs take one form: time them in separate runs")])
def test_zoo_with_another_form_is_refused(argv, words, capsys):
    # The zoo's shapes are varlen whatever --form says: --form batched was ignored without a
    # word (and --configs were checked as batched ones, then timed on varlen shapes).
    assert cli.main(["--zoo", "--models", "Mixtral-8x7B", "--tokens", "16", *argv,
                     "--list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-gemm tune: --form") and words in err and err.count("\n") == 1


def test_zoo_beside_batched_shapes_keeps_each_form(capsys):
    # --form applies to the --shapes items, as its help says; the zoo's stay varlen.
    assert cli.main(["--zoo", "--models", "Mixtral-8x7B", "--tokens", "16", "--shapes",
                     "8,512,256,64", "--form", "batched", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and " batched E=8 N=512 K=256 " in lines[0]
    assert all(" varlen E=8 " in line for line in lines[1:])


def test_list_of_a_shape_near_int32_rows_is_quick():
    # Its routing was drawn row by row: --list printed nothing for about an hour.
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-m", "moe_gemm.tuning", "--shapes",
                           "8,64,64,2147483647", "--list"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "E=8 N=64 K=64 rows=2147483647" in done.stdout


@pytest.mark.parametrize("layout", ["ENK", "EKN"])
def test_zoo_with_a_layout_is_refused(layout, capsys):
    # The zoo's shapes keep each checkpoint's layout (a table's keys carry none, so another
    # layout's picks would replace theirs): --layout was ignored without a word.
    assert cli.main(["--zoo", "--models", "gpt-oss-120b", "--tokens", "16", "--layout", layout,
                     "--list"]) == 2
    err = capsys.readouterr().err
    assert err == (f"moe-gemm tune: --layout {layout} is for --shapes; the zoo's shapes take "
                   "each model's own weight layout (ENK or EKN, as --list shows)\n")


def test_zoo_beside_shapes_in_a_layout_keeps_each_layout(capsys):
    # --layout applies to the --shapes items, as its help says; the zoo's keep their own.
    assert cli.main(["--zoo", "--models", "gpt-oss-120b,Mixtral-8x7B", "--tokens", "16",
                     "--shapes", "8,512,256,64", "--layout", "EKN", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5 and lines[0].endswith(" EKN")  # the --shapes item
    assert [line.split()[-1] for line in lines[1:]] == ["EKN", "EKN", "ENK", "ENK"]
    assert cli.main(["--shapes", "8,512,256,64", "--list"]) == 0
    assert capsys.readouterr().out.rstrip().endswith(" ENK")  # the default
