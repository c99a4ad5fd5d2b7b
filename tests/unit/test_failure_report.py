"""The launcher names the root-cause rank, not a rank that merely lost its connection to it."""
import types

from portable_fsdp.backends.torch.launch import report_failure


def failure(exitcode, message, timestamp):
    return types.SimpleNamespace(exitcode=exitcode, message={"message": message}, timestamp=timestamp)


def test_the_rank_that_raised_is_named_not_the_one_that_lost_its_peer(capsys):
    err = types.SimpleNamespace(failures={
        0: failure(1, "RuntimeError: [gloo/transport/tcp/pair.cc:547] Connection closed by peer [127.0.0.1]:1", 100),
        1: failure(1, "RuntimeError: injected fault at step (rank 1, step 3)", 100)})
    assert report_failure(err) == 1
    assert capsys.readouterr().err.strip() == ("error: worker rank 1 failed (exit code 1): RuntimeError: injected "
                                               "fault at step (rank 1, step 3)")


def test_a_killed_rank_and_mixed_reported_codes(capsys):
    killed = types.SimpleNamespace(failures={1: failure(-9, "", 5), 0: failure(-15, "", 6)})
    assert report_failure(killed) == 1
    assert capsys.readouterr().err.strip() == "error: worker rank 1 failed (exit code -9): killed by signal 9"
    assert report_failure(types.SimpleNamespace(failures={0: failure(2, "", 1), 1: failure(130, "", 1)})) == 130
