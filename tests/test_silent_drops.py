"""Settings that would act on nothing, or ruin a run without a word, are refused before
training; figures a run would leave out are said at set-up (issue 60, items 5 and 6)."""

import pytest

from edgepfl.errors import ConfigError
from tests.conftest import fast_config


# -- 5. privacy settings given without privacy.level -------------------------------------------
@pytest.mark.parametrize("given", [["privacy.noise_multiplier=2.0"],
                                   ["privacy.target_epsilon=3.0"],
                                   ["privacy.noise_multiplier=2.0", "privacy.target_epsilon=3"]])
def test_privacy_settings_without_a_level_are_refused_naming_the_level_to_add(given):
    with pytest.raises(ConfigError, match=r"given without privacy.level.*add privacy.level = "
                                          r"'client' or 'sample'"):
        fast_config(*given)
    fast_config("privacy.level=none", *given)  # said to be 'none': warned of at set-up
    fast_config("privacy.level=client", *given)


# -- 5. noise that drowns any model ------------------------------------------------------------
def test_noise_beyond_a_million_is_refused_with_the_bound():
    with pytest.raises(ConfigError, match=r"noise_multiplier = 1e\+30: beyond 1e\+06 epsilon "
                                          r"is already 0.0.*from 0 to 1e\+06"):
        fast_config("privacy.level=client", "privacy.noise_multiplier=1e30")
    with pytest.raises(ConfigError, match=r"noise_multiplier x privacy.clip = 1e\+09"):
        fast_config("privacy.level=sample", "privacy.clip=1e9")
    fast_config("privacy.level=client", "privacy.noise_multiplier=1e6")
    fast_config("privacy.level=client", "privacy.noise_multiplier=0", "privacy.clip=1e9")


# -- 6. sample-level pld accounting at a noise it cannot hold ----------------------------------
def test_pld_accounting_of_a_tiny_noise_is_refused_before_training():
    pld = ["privacy.level=sample", "privacy.accountant=pld"]
    with pytest.raises(ConfigError, match=r"noise_multiplier = 1e-06 is below 0.3, the least "
                                          r"the pld accountant takes.*privacy.accountant = 'rdp'"):
        fast_config(*pld, "privacy.noise_multiplier=1e-6")
    with pytest.raises(ConfigError, match=r"raise privacy.noise_multiplier to 0.3 or more$"):
        fast_config(*pld, "privacy.relation=replace_one", "privacy.noise_multiplier=1e-6")
    fast_config(*pld, "privacy.noise_multiplier=0.3")
    fast_config("privacy.level=sample", "privacy.noise_multiplier=1e-6")  # rdp: quick


# -- 5. test samples no client holds, and clients a fraction left without any ----------------
def _npz(path, y, y_test, **arrays):
    import numpy as np

    rng = np.random.default_rng(0)
    np.savez(path, x=rng.integers(0, 256, (len(y), 1, 8, 8), dtype=np.uint8), y=y,
             x_test=rng.integers(0, 256, (len(y_test), 1, 8, 8), dtype=np.uint8),
             y_test=y_test, **arrays)
    return ["dataset.name=npz", f"dataset.path={path}", "model.name=mlp", "train.rounds=1",
            "partition.clients=3"]


def test_test_samples_of_a_class_never_trained_on_are_counted_at_set_up(tmp_path, caplog):
    import numpy as np

    from edgepfl.engine.simulation import Simulation

    over = _npz(tmp_path / "d.npz", np.arange(60) % 2, np.arange(20) % 3)
    Simulation(fast_config(*over), progress=False)
    assert ("6 of 20 test samples are in no client's test data and are scored nowhere "
            "(by class: 2 (6, never in training))") in caplog.text


def test_a_run_with_no_test_sample_at_all_is_refused_leaving_no_directory(tmp_path):
    import numpy as np

    from edgepfl.engine.simulation import start_run
    from edgepfl.errors import DataError

    over = _npz(tmp_path / "d.npz", np.arange(60) % 2, np.full(20, 2))
    out = tmp_path / "run"
    with pytest.raises(DataError, match=r"no client has a test sample \(20 in the data set\), "
                                        r"so no accuracy could be reported"):
        start_run(fast_config(*over), out, progress=False)
    assert not out.exists()


def test_clients_a_fraction_leaves_without_test_data_are_named(tmp_path, caplog):
    import numpy as np

    from edgepfl.engine.simulation import Simulation

    names = np.array([f"site{k}" for k in range(8)])
    over = _npz(tmp_path / "d.npz", np.arange(400) % 2, np.arange(16) % 2,
                client=names[np.arange(400) % 8], client_test=names[np.arange(16) % 8])
    Simulation(fast_config(*over, "partition.scheme=natural", "partition.clients=8",
                           "dataset.fraction=0.3"), progress=False)
    assert ("3 of 8 clients have no test samples (clients site2, site3, site6; "
            "dataset.fraction = 0.3 kept none of their test samples)") in caplog.text


def test_a_summary_without_a_scored_round_says_why(capsys):
    from edgepfl.cli import _print_summary

    summary = {"algorithm": "fedavg", "dataset": "npz", "clients": 3, "rounds": 1,
               "acc_mean_best": None, "best_round": None, "acc_mean_final": None,
               "acc_std_final": None, "acc_min_final": None, "bytes_up_total": 0,
               "bytes_down_total": 0, "wall_time_s": 0.0}
    _print_summary(summary, None)
    out = capsys.readouterr().out
    assert "round None" not in out
    assert "best mean acc - (no round scored a test sample: no client holds one)" in out
