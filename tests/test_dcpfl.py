"""Defining properties of DC-PFL (edgepfl.algorithms.dcpfl)."""

import json
import math

import numpy as np
import pytest
import torch

from edgepfl.algorithms import ALGORITHMS
from edgepfl.algorithms.dcpfl import (
    NORMAL,
    SYNC,
    TRIAL,
    cut,
    discrepancy_matrix,
    group_graph,
    group_purity,
    layer_discrepancy,
    layers_due,
    low_layers,
    radius_of_curvature,
    rdp_ended,
    reference_discrepancy,
    refines,
)
from edgepfl.engine.simulation import Simulation, resume_run, start_run
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message
from tests.conftest import fast_config

# short phases so that a few seconds of training see warm-up, splits and trials
QUICK = ("algorithm.name=dcpfl", "algorithm.t_start=2", "algorithm.s=2", "algorithm.t_obv=1",
         "algorithm.t_sp=1", "algorithm.tau=2", "algorithm.alpha=2", "dataset.fraction=0.4")


def test_registered():
    assert "dcpfl" in ALGORITHMS
    hp = ALGORITHMS["dcpfl"].hyperparameters()
    assert (hp.t_start, hp.s, hp.t_obv, hp.t_sp, hp.lambda_gamma, hp.tau, hp.alpha, hp.low_ratio) == (
        5, 5, 3, 6, 0.2, 5, 3, 0.1)


@pytest.mark.tolerance
def test_discrepancy_symmetric_zero_diagonal_affine_invariant():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(5, 300, generator=gen)
    d = discrepancy_matrix(w)
    assert torch.allclose(d, d.T)
    assert torch.all(d.diagonal() == 0)
    assert (d + torch.eye(5)).min() > 0  # distinct models are apart
    moved = w.clone()
    moved[2] = 3.7 * moved[2] - 1.25  # a positive affine change of client 2's weights
    assert torch.allclose(discrepancy_matrix(moved), d, atol=1e-12)
    flipped = w.clone()
    flipped[2] = -flipped[2]  # not positive: must change the discrepancy
    assert not torch.allclose(discrepancy_matrix(flipped), d)


def test_discrepancy_is_mean_l1_of_minmax_scaled_weights():
    w = torch.tensor([[0.0, 1.0, 2.0, 4.0], [1.0, 1.0, 3.0, 5.0]])
    # S(w0) = [0, .25, .5, 1], S(w1) = [0, 0, .5, 1]; L1 = .25; / dim 4
    assert math.isclose(float(discrepancy_matrix(w)[0, 1]), 0.0625)
    assert math.isclose(layer_discrepancy(w, w[0]), 0.0625 / 2)


def test_group_graph_extremes_and_nesting():
    gen = torch.Generator().manual_seed(1)
    centres = torch.randn(3, 50, generator=gen) * 5
    w = torch.cat([centres[i % 3] + 0.1 * torch.randn(1, 50, generator=gen) for i in range(9)])
    disc = discrepancy_matrix(w).numpy()
    z, gamma_global = group_graph(disc)
    assert gamma_global == z[:, 2].max() > 0
    assert cut(z, gamma_global, 1.0, 9) == [0] * 9
    assert sorted(cut(z, gamma_global, 0.0, 9)) == list(range(9))
    previous = cut(z, gamma_global, 1.0, 9)
    for g in np.linspace(1, 0, 21):
        labels = cut(z, gamma_global, float(g), 9)
        assert refines(labels, previous)
        previous = labels
    # the three planted clusters are found somewhere on the way down
    assert any(cut(z, gamma_global, float(g), 9) == [0, 1, 2] * 3 for g in np.linspace(1, 0, 101))


def test_group_graph_is_average_linkage():
    # a, b close; c far: average distance of {a,b} to c is the mean of d(a,c), d(b,c)
    disc = np.array([[0, 1, 4], [1, 0, 6], [4, 6, 0]], dtype=float)
    z, gamma_global = group_graph(disc)
    assert gamma_global == 5.0  # single linkage would say 4, complete 6


def test_radius_of_curvature_detector():
    t = np.arange(1, 61)
    knee = 25
    curve = list(np.log1p(np.exp(-(t - knee) / 2.0)) * 2.0 + 0.1)  # steep line, then flat
    fired = [k for k in range(1, 61) if rdp_ended(curve[:k], 5, 3)]
    assert fired, "no RDP end detected on a curve with a clear knee"
    assert knee - 2 <= fired[0] <= knee + 12
    line = list(5.0 - 0.1 * t)
    assert not any(rdp_ended(line[:k], 5, 3) for k in range(1, 61))
    assert not any(rdp_ended(curve[:k], 5, 3) for k in range(1, knee - 5))
    r = radius_of_curvature(curve, 5)
    assert all(math.isnan(x) for x in r[:6]) and not math.isnan(r[6])


@pytest.mark.tolerance
def test_smoothing_window_cancels_a_loss_pattern_of_its_own_period():
    # the loss a client reports jumps each time it receives a fresh aggregate (every tau
    # rounds); with the window as long as that period the jump must not reach l' and l'',
    # so r(t) follows the smooth decay underneath instead of the aggregation rhythm
    t = np.arange(1, 61)
    decay = 2.0 * np.exp(-t / 15.0)
    jumpy = list(decay + 0.5 * (t % 5 == 0))
    r_smooth = radius_of_curvature(list(decay), 5)
    r_jumpy = radius_of_curvature(jumpy, 5)
    for a, b in zip(r_smooth, r_jumpy, strict=True):
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6)


@pytest.mark.tolerance
def test_eq6_and_schedule():
    assert low_layers([1.0, 0.05, 2.0, 0.9], 0.1) == [False, True, False, False]
    # against the model's total (3.95) a layer is low below 0.395: here 0.05 and 0.3
    assert reference_discrepancy([1.0, 0.05, 2.0, 0.9], "total") == pytest.approx(3.95)
    assert low_layers([1.0, 0.05, 2.0, 0.3], 0.1, "total") == [False, True, False, True]
    assert low_layers([1.0, 0.05, 2.0, 0.3], 0.1, "mean") == [False, True, False, False]
    low = [True, False]
    due = [layers_due(r, 10, low, tau=2, alpha=3) for r in range(10, 23)]
    assert [d[1] for d in due] == [r > 10 and (r - 10) % 2 == 0 for r in range(10, 23)]
    assert [d[0] for d in due] == [r > 10 and (r - 10) % 6 == 0 for r in range(10, 23)]


def test_groupings_only_split_and_do_split():
    sim = Simulation(fast_config(*QUICK, "train.rounds=14"), progress=False)
    groups = [sim.step()["groups"] for _ in range(14)]
    history = [labels for _, _, labels in sim.server.history]
    assert len(history) >= 2, "no split happened"
    for coarse, fine in zip(history, history[1:], strict=False):
        assert refines(fine, coarse) and len(set(fine)) > len(set(coarse))
    assert groups == sorted(groups)


def test_unaggregated_layer_costs_no_bytes():
    # low_ratio = 1: layers below the group's mean discrepancy are aggregated every alpha*tau
    sim = Simulation(fast_config(*QUICK, "algorithm.low_ratio=1.0", "algorithm.low_reference=mean",
                                 "algorithm.s=50", "train.rounds=8"), progress=False)
    layer_bytes = [sum(sim.server.group.tensors[p][0].numel() * 4 for p in sim.layers.params_of(i))
                   for i in range(len(sim.layers))]
    full = sum(layer_bytes)
    for _ in range(2):
        row = sim.step()
    srv = sim.server
    assert srv.mode == NORMAL
    low = srv.low[0].tolist()
    assert any(low) and not all(low)
    # the Eq. 6 classification is logged: one group, so every client has the same low layers
    assert row["low_layers_mean"] == sum(low)
    assert 0 <= row["layer_disc_ratio_min"] < 1.0
    for _ in range(6):
        rnd = sim.round + 1
        low = srv.low[0].tolist()  # re-derived at every full synchronisation
        due = layers_due(rnd, srv.phase_start, low, srv.tau_rounds, srv.hp.alpha)
        row = sim.step()
        payload = sum(b for b, d in zip(layer_bytes, due, strict=True) if d) * 6
        assert payload <= row["bytes_up"] < payload + 6 * 120, (rnd, due)
        if not all(due):
            assert row["bytes_up"] < 6 * full
        if not any(due):
            assert row["bytes_up"] < 6 * 120


@pytest.mark.tolerance
def test_trial_keeps_new_grouping_only_if_loss_lower():
    sim = Simulation(fast_config(*QUICK, "train.rounds=3"), progress=False)
    for _ in range(2):
        sim.step()
    srv = sim.server
    model = {k: v.clone() for k, v in sim.server.ctx.init_model.items()}

    def trained(tag: int, cid: int) -> dict[str, torch.Tensor]:
        # distinct models per client and per trial model, so keeping the wrong one shows
        return {k: v + 10.0 * tag + cid for k, v in model.items()}

    for l0, l1, accepted in ((1.0, 2.0, False), (2.0, 1.0, True)):
        srv.mode, srv.labels, srv.proposal, srv.proposal_gamma = TRIAL, [0] * 6, [0, 0, 0, 1, 1, 1], 0.8
        srv.retry_at = -1
        replies = {c: Message({**{f"m0.{k}": v for k, v in trained(0, c).items()},
                               **{f"m1.{k}": v for k, v in trained(1, c).items()}},
                              {"num_samples": 10, "loss0": l0, "loss1": l1}) for c in range(6)}
        srv.aggregate(7, replies)
        assert (srv.labels == [0, 0, 0, 1, 1, 1]) is accepted
        assert (srv.retry_at == 7 + srv.hp.t_sp) is not accepted
        # the weights trained from the kept grouping's model are kept, and each group's
        # model is the (equal-sample) average of its members' kept weights
        kept = 1 if accepted else 0
        groups = [[0, 1, 2], [3, 4, 5]] if accepted else [list(range(6))]
        for members in groups:
            for cid in members:
                row, group = srv.uploads.row(cid), srv.group.row(cid)
                for k in model:
                    assert torch.allclose(row[k], trained(kept, cid)[k])
                    mean = torch.stack([trained(kept, c)[k] for c in members]).mean(0)
                    assert torch.allclose(group[k].float(), mean.float(), atol=1e-5)


def test_resume_reproduces_metrics(tmp_path):
    cfg = fast_config(*QUICK, "train.rounds=10")
    full = start_run(cfg, tmp_path / "full", progress=False).metrics
    part = fast_config(*QUICK, "train.rounds=10", "output.checkpoint_every=100")
    sim = Simulation(part, tmp_path / "part", progress=False)
    sim._write_setup()
    for _ in range(7):
        sim.step()
    sim.save_checkpoint()
    resumed = resume_run(tmp_path / "part", progress=False).metrics
    keys = ["acc_mean", "loss", "train_loss", "bytes_up", "bytes_down", "groups"]
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in full]
    assert (tmp_path / "full" / "dcpfl_groups.json").exists()


def test_nodc_ablation_keeps_the_cut_at_the_fixed_threshold():
    sim = Simulation(fast_config(*QUICK, "train.rounds=14", "algorithm.fixed_gamma=0.5"),
                     progress=False)
    rows = [sim.step() for _ in range(14)]
    server = sim.server
    expected = cut(server.z.numpy(), server.gamma_global, 0.5, sim.num_clients)
    assert server.labels == expected
    assert [g for _, g, _ in server.history] == [1.0, 0.5]  # start, then the one fixed cut
    after = [r for r in rows if r["round"] > 2]
    assert all(r["gamma_tilde"] == 0.5 for r in after)
    assert {r["groups"] for r in after} == {float(len(set(expected)))}
    assert all(r.get("trial_accepted") is None or math.isnan(r["trial_accepted"]) for r in after)


@pytest.mark.tolerance
def test_trial_reaches_clients_whose_group_missed_the_sync_round():
    # with partial participation a group may have no member in the sync round; its
    # members must still get both an old (M0) and a proposed (M1) model in the trial
    from edgepfl.algorithms.dcpfl import SYNC, TRIAL

    sim = Simulation(fast_config(*QUICK, "train.rounds=4"), progress=False)
    server, n = sim.server, sim.num_clients
    server.built = True
    server.labels = [0] * (n // 2) + [1] * (n - n // 2)
    server.proposal = list(range(n))
    server.mode = SYNC
    init = {k: v.clone() for k, v in server.group.row(0).items()}
    every_layer = list(range(len(sim.layers)))
    replies = {c: Message({k: v + 1.0 for k, v in init.items()},
                          {"num_samples": 10, "loss": 1.0, "up": every_layer})
               for c in range(n // 2)}  # group 1 sends nothing
    server.aggregate(5, replies)
    assert server.mode == TRIAL
    expected = {f"m{m}.{k}" for m in (0, 1) for k in server.names}
    for cid, msg in server.configure(6, list(range(n))).items():
        assert set(msg.tensors) == expected, cid
        if cid >= n // 2:  # no fresh model: both are its current group model
            for k in server.names:
                torch.testing.assert_close(msg.tensors[f"m0.{k}"], init[k])
                torch.testing.assert_close(msg.tensors[f"m1.{k}"], init[k])


# -- partial participation: pairs never selected together in the warm-up -------------------
def _measured_components(members: list[int], seen: np.ndarray) -> int:
    """How many pieces ``members`` fall into when joined only by measured pairs."""
    todo, pieces = set(members), 0
    while todo:
        pieces += 1
        stack = [todo.pop()]
        while stack:
            c = stack.pop()
            near = {d for d in todo if seen[c, d]}
            todo -= near
            stack += near
    return pieces


@pytest.mark.tolerance
def test_pairs_never_selected_together_are_not_identical(tmp_path):
    # the audit's case: 8 clients, a quarter of them per round, so 2 per round and 5 of the
    # 28 pairs measured in the 5 warm-up rounds; the rest used to average 0/1 = "identical"
    cfg = fast_config("algorithm.name=dcpfl", "partition.clients=8", "train.participation=0.25",
                      "train.rounds=6", "dataset.fraction=0.4")
    sim = Simulation(cfg, progress=False)
    with pytest.warns(UserWarning, match="never selected together"):
        rows = [sim.step() for _ in range(5)]
    server = sim.server
    assert server.built and rows[-1]["round"] == server.hp.t_start
    count = server.disc_count.numpy()
    seen = count > 0
    off = ~np.eye(8, dtype=bool)
    assert (~seen & off).any(), "every pair was measured: not the audit's case"
    server.write_artifacts(tmp_path, plots=False)
    used = np.array(json.loads((tmp_path / "dcpfl_groups.json").read_text())["discrepancy"])
    # the matrix the group graph was built from: no pair reads as identical, no client's row
    # is all zeros, and the measured pairs are the warm-up averages as before
    assert (used[off] > 0).all(), used
    assert all((used[i][off[i]] > 0).any() for i in range(8))
    measured = seen & off
    avg = (server.disc_sum / server.disc_count.clamp(min=1)).numpy()
    assert np.array_equal(used[measured], avg[measured])
    assert np.allclose(used, used.T)
    # no group below gamma~ = 1 is held together by an unmeasured pair: each multi-client
    # group is connected through pairs that were measured
    z = server.z.numpy()
    for g in np.linspace(0.8, 0.0, 5):
        labels = cut(z, server.gamma_global, float(g), 8)
        for members in server._members(labels).values():
            assert _measured_components(members, seen) == 1, (g, labels, members)
    assert rows[-1]["disc_pairs_imputed"] == float((~seen & off).sum() // 2)


@pytest.mark.tolerance
def test_complete_discrepancy_equals_floyd_warshall_over_the_measured_pairs():
    from edgepfl.algorithms.dcpfl import complete_discrepancy

    rng = np.random.default_rng(0)
    for n, share in ((30, 0.08), (60, 0.2), (40, 0.02)):  # the last leaves clients unjoined
        d = np.abs(rng.normal(size=(n, n)))
        d = d + d.T
        d[rng.random((n, n)) < 0.05] = 0.0  # identical clients: a measured 0 is a short cut
        d = np.triu(d, 1) + np.triu(d, 1).T
        seen = np.triu(rng.random((n, n)) < share, 1)
        seen = seen | seen.T
        ref = np.where(seen, d, np.inf)
        np.fill_diagonal(ref, 0.0)
        for k in range(n):
            ref = np.minimum(ref, ref[:, k:k + 1] + ref[k:k + 1, :])
        ref = np.where(seen, d, ref)
        finite = ref[np.isfinite(ref)]
        ref[~np.isfinite(ref)] = finite.max()
        np.fill_diagonal(ref, 0.0)
        assert np.allclose(complete_discrepancy(d, seen), ref, rtol=1e-12, atol=0)


@pytest.mark.tolerance
def test_complete_discrepancy_chains_measured_pairs():
    from edgepfl.algorithms.dcpfl import complete_discrepancy

    avg = np.array([[0.0, 0.1, 0.0, 0.0, 0.0],
                    [0.1, 0.0, 0.2, 0.0, 0.0],
                    [0.0, 0.2, 0.0, 0.0, 0.0],
                    [0.0, 0.0, 0.0, 0.0, 0.05],
                    [0.0, 0.0, 0.0, 0.05, 0.0]])
    seen = avg > 0
    d = complete_discrepancy(avg, seen)
    assert d[0, 1] == 0.1 and d[1, 2] == 0.2 and d[3, 4] == 0.05  # measured: kept
    assert d[0, 2] == pytest.approx(0.3)  # through the shared neighbour 1
    assert d[0, 3] == d[2, 4] == pytest.approx(0.3)  # no chain: the largest entry
    assert np.array_equal(d, d.T) and (np.diag(d) == 0).all()
    full = np.abs(np.subtract.outer(np.arange(4.0), np.arange(4.0)))
    assert complete_discrepancy(full, np.ones((4, 4), dtype=bool)) is full  # untouched
    nothing = complete_discrepancy(np.zeros((3, 3)), np.zeros((3, 3), dtype=bool))
    assert (nothing[~np.eye(3, dtype=bool)] == 1.0).all()


# -- tau counts local epochs ------------------------------------------------------------------
def test_tau_counts_local_epochs():
    from edgepfl.algorithms.dcpfl import tau_rounds

    assert tau_rounds(5, 1) == 5  # one epoch a round: tau rounds, as before
    assert tau_rounds(5, 5) == 1  # the engine's 5 local epochs: every round, not every 25 epochs
    assert tau_rounds(10, 5) == 2
    # 2 local epochs a round, tau = 2 epochs: high layers every round, low ones every alpha
    sim = Simulation(fast_config(*QUICK, "train.local_epochs=2", "algorithm.low_ratio=1.0",
                                     "algorithm.low_reference=mean",
                                 "algorithm.s=50", "train.rounds=5"), progress=False)
    srv, nl = sim.server, len(sim.layers)
    assert srv.tau_rounds == 1
    assert [sim.step()["mode"] for _ in range(2)] == [0, 0]  # warm-up; schedule starts at 2
    # rounds 3, 4, 5 are 2, 4, 6 epochs in: high layers each round, every layer at 4 epochs
    # (alpha * tau); Eq. 6 is re-derived at that full synchronisation
    for full in (False, True, False):
        low = int(srv.low[0].sum())
        assert 0 < low < nl
        row = sim.step()
        assert row["mode"] == NORMAL
        assert row["layers_up_mean"] == (nl if full else nl - low), row["round"]


def test_tau_that_is_not_a_multiple_of_local_epochs_is_refused():
    with pytest.raises(ConfigError, match=r"algorithm.tau = 5 .*train.local_epochs = 2.*4 or 6"):
        Simulation(fast_config("algorithm.name=dcpfl", "train.local_epochs=2"), progress=False)


@pytest.mark.tolerance
def test_discrepancy_without_the_flat_matrix_equals_eq3_and_eq5_on_it():
    """The streamed forms (column chunks over the clients' tensors; one client's layer at a
    time) give Eq. 3's and Eq. 5's values on the [n, dim] matrix."""
    from edgepfl.algorithms.dcpfl import discrepancy_of, minmax

    torch.manual_seed(0)
    models = [[torch.randn(7, 5) * (c + 1), torch.randn(300) + c, torch.full((4,), 2.0)]
              for c in range(5)]
    models.append([torch.zeros(7, 5), torch.zeros(300), torch.zeros(4)])  # no range: S = 0
    flat = torch.stack([torch.cat([t.flatten() for t in m]) for m in models]).double()
    s = minmax(flat)
    eq3 = torch.cdist(s, s, p=1) / flat.shape[1]
    assert torch.allclose(discrepancy_of(models, chunk=64), eq3, rtol=1e-12, atol=1e-15)
    assert torch.allclose(discrepancy_matrix(flat), eq3, rtol=1e-12, atol=1e-15)
    g = flat[2] * 0.5 + 1
    eq5 = float((s - minmax(g.reshape(1, -1))).abs().sum(dim=1).mean()) / flat.shape[1]
    assert math.isclose(layer_discrepancy(iter(list(flat)), g), eq5, rel_tol=1e-12)
    assert math.isclose(layer_discrepancy(flat, g), eq5, rel_tol=1e-12)


@pytest.mark.tolerance
def test_client_reports_the_received_models_loss_and_trains_trial_models_alike():
    from edgepfl.federation.rng import generator

    sim = Simulation(fast_config(*QUICK, "train.rounds=4"), progress=False)
    seen = []
    update = sim.client.update

    def update_(cid, msg, state, data, gen):
        result = update(cid, msg, state, data, gen)
        seen.append((cid, msg, {k: v.clone() for k, v in state.items()}, result))
        return result

    sim.client.update = update_
    for _ in range(4):
        start = len(seen)
        row = sim.step()
        losses = [r.reply.meta["loss"] for *_, r in seen[start:] if "loss" in r.reply.meta]
        if losses:  # Eq. 4's l(t): the mean of the round's l_i(t), logged as rdp_loss
            assert row["rdp_loss"] == pytest.approx(float(np.mean(losses)))
    normal = [s for s in seen if s[1].meta.get("mode") == "normal"]
    assert normal, "the run must reach a normal round"
    cid, msg, state, result = normal[-1]
    data = sim.train_data[cid]
    held = {**sim.client.personal_model(state, None), **msg.tensors}
    before = sum(sim.trainer.evaluate(held, x, y)[1] for x, y in data.buckets()) / data.n
    # l_i(t) is the loss of the received model laid over the client's own, before training
    assert result.reply.meta["loss"] == pytest.approx(before, rel=1e-6)
    trained = {k[len("model."):]: v for k, v in result.state.items() if k.startswith("model.")}
    after = sum(sim.trainer.evaluate(trained, x, y)[1] for x, y in data.buckets()) / data.n
    assert after != pytest.approx(before, rel=1e-3)
    # a trial trains M0 and M1 on one batch order: equal models give equal replies
    model = sim.trainer.export()
    trial = Message({**{f"m0.{k}": v for k, v in model.items()},
                     **{f"m1.{k}": v for k, v in model.items()}}, {"mode": "trial"})
    res = sim.client.update(0, trial, sim.clients.row(0), sim.train_data[0], generator(0, "t"))
    assert res.reply.meta["loss0"] == res.reply.meta["loss1"]
    assert all(torch.equal(res.reply.tensors[f"m0.{k}"], res.reply.tensors[f"m1.{k}"]) for k in model)


def test_a_rejected_split_is_tried_again_after_t_sp_rounds_with_the_same_proposal():
    # trials in rounds 8, 12 and 16 (warm-up, normal rounds, a first split proposed in round
    # 8): 16 rounds show the rejected proposal tried twice again, as the 30 once did 5 times
    sim = Simulation(fast_config(*QUICK, "algorithm.t_sp=2", "train.rounds=16"), progress=False)
    trial = sim.client._trial

    def worse_split(msg, data, gen):  # every client finds the proposed groups worse
        result = trial(msg, data, gen)
        result.reply.meta["loss1"] = result.reply.meta["loss0"] + 1.0
        return result

    sim.client._trial = worse_split
    modes, proposals = [], []
    for _ in range(16):
        if sim.server.mode == TRIAL:
            proposals.append(list(sim.server.proposal))
        modes.append(int(sim.step()["mode"]))
    trials = [t for t, m in enumerate(modes) if m == TRIAL]
    assert len(trials) >= 3, modes
    assert all(accepted == 0 for *_, accepted in sim.server.trials)
    assert len(set(map(tuple, proposals))) == 1  # the same proposal each time
    for first, second in zip(trials[:-1], trials[1:], strict=True):
        # t_sp normal rounds with the old grouping, a sync round, then the trial again
        assert modes[first + 1:second] == [NORMAL] * 2 + [SYNC], modes
    assert len(set(sim.server.labels)) == 1  # the old grouping (one group) was kept


def _agree_on_first_layer(sim, spread: float, rnd: int):
    """Overwrite the clients' uploads so that they agree with their group model on layer 0
    (a 1e-6 relative wobble) and disagree on every other layer (``spread`` relative
    noise), then run Eq. 5-6 on them."""
    srv = sim.server
    gen = torch.Generator().manual_seed(0)
    for cid in range(sim.num_clients):
        row = {}
        for i in range(len(sim.layers)):
            scale = 1e-6 if i == 0 else spread
            for name in sim.layers.params_of(i):
                g = srv.group.tensors[name][cid]
                noise = torch.randn(g.shape, generator=gen, dtype=torch.float64).to(g.dtype)
                row[name] = g + scale * g.abs().max() * noise
        srv.uploads.set_row(cid, row)
    srv._classify(srv.labels, rnd)
    return srv


@pytest.mark.parametrize("reference", ["total", "mean"])
def test_a_layer_the_clients_agree_on_is_aggregated_at_the_slow_interval(reference):
    # the defining mechanism of Sec. IV: a layer whose clients agree with their group model
    # is low (Eq. 6) and is then aggregated every alpha*tau rounds only, so its bytes are
    # saved; layers they disagree on stay at every tau rounds. Fails if no layer can be low.
    sim = Simulation(fast_config(*QUICK, f"algorithm.low_reference={reference}", "algorithm.s=50",
                                 "algorithm.tau=1", "algorithm.alpha=3", "train.rounds=9"),
                     progress=False)
    for _ in range(3):
        sim.step()
    srv = sim.server
    assert srv.mode == NORMAL and srv.built
    _agree_on_first_layer(sim, 0.3, sim.round)
    for cid in range(sim.num_clients):
        assert srv.low[cid].tolist() == [True] + [False] * (len(sim.layers) - 1)
    last = srv.classified[-1]
    assert last["reference"] == reference
    assert last["groups"][0]["low"] == [sim.layers.names[0]]
    assert last["groups"][0]["ratios"][0] < 0.1 <= min(last["groups"][0]["ratios"][1:])
    srv.phase_start = sim.round
    asked = []
    configure = srv.configure

    def recording(rnd, selected):
        msgs = configure(rnd, selected)
        asked.append(msgs[0].meta["up"])
        return msgs

    srv.configure = recording
    rows = [sim.step() for _ in range(srv.hp.alpha * srv.tau_rounds)]
    # one group, one low layer: layers_low counts that (group, layer) pair
    assert [r["layers_low"] for r in rows[:-1]] == [1.0] * (len(rows) - 1)
    # tau rounds ask for every layer but the first; the alpha*tau round asks for all
    assert asked[:-1] == [list(range(1, len(sim.layers)))] * (len(asked) - 1)
    assert asked[-1] == list(range(len(sim.layers)))
    assert rows[0]["bytes_up"] < rows[-1]["bytes_up"]


def test_no_layer_is_low_when_the_clients_disagree_alike_on_every_layer():
    sim = Simulation(fast_config(*QUICK, "algorithm.s=50", "train.rounds=3"), progress=False)
    for _ in range(3):
        sim.step()
    srv = sim.server
    gen = torch.Generator().manual_seed(1)
    for cid in range(sim.num_clients):
        srv.uploads.set_row(cid, {n: t[cid] + 0.3 * t[cid].abs().max() *
                                  torch.randn(t[cid].shape, generator=gen, dtype=t.dtype)
                                  for n, t in srv.group.tensors.items()})
    srv._classify(srv.labels, sim.round)
    assert not srv.low.any()
    assert srv._layers_low() == 0
    srv.low[:] = True  # every layer low, but NoLA has no slower interval to run them at
    assert srv._layers_low() > 0
    srv.hp = srv.hp.model_copy(update={"alpha": 1})
    assert srv._layers_low() == 0


@pytest.mark.tolerance
def test_layers_low_is_reported_and_purity_follows_the_primary_classes(tmp_path):
    history = [(0, 1.0, [0, 0, 0, 0]), (7, 0.8, [0, 0, 1, 1])]
    counts = [[9, 1, 0], [8, 0, 2], [1, 9, 0], [0, 1, 9]]
    part = tmp_path / "partition.json"
    part.write_text(json.dumps({"clients": [{"train_class_counts": c} for c in counts]}))
    out = group_purity(history, part)
    assert out[0]["purity"] == 0.5 and out[0]["until_round"] == 7
    assert out[1]["purity"] == 0.75 and out[1]["until_round"] is None
    assert out[1]["groups"][1] == {"clients": [2, 3], "primary_classes": [1, 2], "purity": 0.5}
    # primary classes 0, 0, 1, 2: one pair of six shares a class; the split keeps it
    # together in one of its two within-group pairs
    assert out[0]["same_primary_chance"] == pytest.approx(1 / 6)
    assert out[1]["same_primary"] == 0.5 and out[0]["same_primary"] == pytest.approx(1 / 6)
    assert group_purity(history, tmp_path / "missing.json") is None
    run = start_run(fast_config(*QUICK, "train.rounds=6"), tmp_path / "run", progress=False)
    assert all("layers_low" in r for r in run.metrics)
    groups = json.loads((tmp_path / "run" / "dcpfl_groups.json").read_text())
    assert groups["purity"][0]["from_round"] == 0 and groups["classifications"]
    ratios = [r for r in run.metrics if not math.isnan(r.get("layer_disc_ratio_min", math.nan))]
    assert ratios and all(f"disc_ratio.{n}" in ratios[0] for n in
                          json.loads((tmp_path / "run" / "partition.json").read_text())
                          ["layers"]["layers"][0]["name"].split())


def test_evaluate_group_is_fedavg_and_local_is_local_in_the_first_round():
    # round 1 is a warm-up round: every client trains from the same initial model, and the
    # group is everyone, so the group model is FedAvg's global model and a client's own
    # trained model is Local's after one round
    def first(*overrides):
        return Simulation(fast_config(*overrides), progress=False).step()["acc_mean"]

    assert first(*QUICK) == first("algorithm.name=fedavg", "dataset.fraction=0.4")
    assert first(*QUICK, "algorithm.evaluate=local") == first("algorithm.name=local",
                                                              "dataset.fraction=0.4")
    assert first(*QUICK) != first(*QUICK, "algorithm.evaluate=local")
