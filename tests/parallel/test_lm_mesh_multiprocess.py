"""The language model's training run of tests/parallel/test_lm_mesh.py over a (1, 8) mesh of two
processes (`jax.distributed`, 4 host devices each, cross-process collectives by gloo;
tests/support/ep_worker.py, suite "lm", is each process's script): the all-to-alls and every
gradient's gather cross the processes, the batch is fed from each process's rows and the
parameters are split over both; every step's loss, the final parameters and expert biases have
the bits of one process's 8 devices. Control: one process's run with a changed token (of
process 1's rows) differs."""

import numpy as np
from ep_worker import flat, load
from test_expert_parallel_multiprocess import run_workers
from test_lm_mesh import Run, changed_token, config, training_batches, write_corpus

from bitwise import assert_bitwise, differs

MULTIPROCESS_MESH = (1, 8)


def test_two_processes_give_the_bits_of_one(tmp_path):
    run_workers(tmp_path / "results.npz", tmp_path, suite="lm")
    got = load(str(tmp_path / "results.npz"))
    (tmp_path / "corpus").mkdir()
    write_corpus(tmp_path / "corpus")
    cfg = config(tmp_path / "corpus", mesh=MULTIPROCESS_MESH)
    batches = training_batches(cfg)
    run = Run(cfg, batches[0])
    losses, _, params, rest = run(batches)
    assert_bitwise(got["losses"], losses)
    for name, tree in (("params", params), ("rest", rest)):
        want = flat(tree)
        assert sorted(k.removeprefix(name) for k in got if k.startswith(name)) == sorted(want)
        for key, value in want.items():
            assert_bitwise(got[name + key], value)
    other = run(changed_token(batches))[0]
    assert differs(got["losses"][:1], other[:1])
    assert np.all(np.isfinite(got["losses"]))
