"""benchmarks.sustained on the CPU: its arguments and the implementations it names (the
sustained samples themselves need a CUDA GPU and NVML)."""

from __future__ import annotations

import pytest

from benchmarks import sustained, zoo


def test_implementations_by_name_and_configs_of_ours():
    impls = sustained.implementations(None, ["default", "quack", "mm_loop",
                                             "pp 128x192 c1x2 p8ns"])
    assert [i.name for i in impls] == [zoo.DEFAULT_NAME, zoo.QUACK_NAME, zoo.GRAPH_NAME,
                                       "moe_gemm pp 128x192 c1x2 p8ns"]
    assert [i.peer for i in impls] == [False, True, True, False]
    pinned = impls[3].config
    assert (pinned.schedule, pinned.tile_m, pinned.tile_n, pinned.cluster_n) == (
        "pingpong", 128, 192, 2)


@pytest.mark.parametrize("word", ["cublas", "pp 100x100", "coop 128x256 c3x1"])
def test_an_unknown_implementation_is_refused(word):
    with pytest.raises(ValueError):
        sustained.implementations(None, [word])


def test_bad_arguments_exit_2_with_a_reason(capsys):
    assert sustained.main(["--cases", "DeepSeek-V3/gate_up/8192", "--seconds", "0"]) == 2
    assert "--seconds must be a positive finite number" in capsys.readouterr().err
    assert sustained.main(["--cases", "NoSuchModel/gate_up/8192"]) == 2
    assert "sustained:" in capsys.readouterr().err
    assert sustained.main(["--cases", "DeepSeek-V3/gate_up/8192", "--reps", "0"]) == 2
    assert "--reps must be at least 1" in capsys.readouterr().err


def test_without_a_gpu_it_says_what_it_needs(capsys):
    assert sustained.main(["--cases", "OLMoE-1B-7B/down/8192", "--device", "cpu"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bad_implementations_are_refused_before_any_gpu_work(capsys):
    assert sustained.main(["--cases", "OLMoE-1B-7B/down/8192", "--device", "cpu",
                           "--impls", "default,pp 100x100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sustained:") and "needs a CUDA GPU" not in err
    assert sustained.main(["--cases", "OLMoE-1B-7B/down/8192", "--impls", " , "]) == 2
    assert "--impls: an empty entry in ' , '" in capsys.readouterr().err
