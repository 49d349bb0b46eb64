import pytest
import torch

from edgepfl.errors import ConfigError
from edgepfl.models import MODELS, LayerSpec, build_model


def test_cnn2_matches_the_kapc_description():
    model = build_model("cnn2", (1, 28, 28), 10)
    spec = LayerSpec.from_model(model)
    assert spec.names == ["conv1", "conv2", "fc1", "fc2", "fc3"]
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [c.kernel_size for c in convs] == [(5, 5), (5, 5)]
    assert [model.fc1.out_features, model.fc2.out_features] == [512, 128]
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


@pytest.mark.parametrize("name,shape", [("cnn2", (1, 28, 28)), ("cnn_cifar", (3, 32, 32)),
                                        ("cnn_small", (1, 8, 8)), ("mlp", (1, 8, 8))])
def test_layer_spec_owns_every_parameter_exactly_once(name, shape):
    model = build_model(name, shape, 7)
    spec = LayerSpec.from_model(model)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(spec.param_names) == sorted(names)
    assert len(spec.param_names) == len(set(spec.param_names))
    assert sum(layer.numel for layer in spec.layers) == sum(p.numel() for p in model.parameters())
    # weight and bias of a module are one layer
    assert spec.params_of(0) == [f"{spec.names[0]}.weight", f"{spec.names[0]}.bias"]
    assert spec.prefix(2) == spec.params_of([0, 1])
    assert spec.layer_of(spec.param_names[-1]) == len(spec) - 1
    with pytest.raises(ValueError):
        spec.prefix(len(spec) + 1)


def test_layer_spec_lists_buffers_separately():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    spec = LayerSpec.from_model(model)
    assert spec.names == ["0", "1"]
    assert set(spec.buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}


def test_unknown_model_and_wrong_input_size_are_clear_errors():
    with pytest.raises(ConfigError, match="nope.*valid: " + ", ".join(MODELS)):
        build_model("nope", (1, 28, 28), 10)
    with pytest.raises(ConfigError, match="cnn2"):
        build_model("cnn2", (1, 8, 8), 10)


def _one_client(seed: int = 0):
    from edgepfl.training.client_data import ClientData

    g = torch.Generator().manual_seed(seed)
    x = torch.rand(96, 3, 28, 28, generator=g)
    y = torch.randint(0, 10, (96,), generator=g)
    return ClientData(x, y, torch.arange(96)), x, y


@pytest.mark.parametrize("name", ["cnn2", "cnn2_bn"])
def test_channels_last_skeleton_trains_the_same_model(name):
    """The channels-last layout is a speed choice: same training, same predictions,
    and weights leave the skeleton in the default layout."""
    from edgepfl.training.trainer import Trainer

    torch.manual_seed(0)
    model = build_model(name, (3, 28, 28), 10)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    data, x, y = _one_client()
    results = {}
    for fast in (False, True):
        trainer = Trainer(build_model(name, (3, 28, 28), 10), channels_last=fast)
        trainer.load(init)
        trainer.fit(data, epochs=2, batch_size=32, lr=0.05,
                    gen=torch.Generator().manual_seed(1))
        state = trainer.export()
        assert all(t.is_contiguous() for t in state.values())
        results[fast] = (state, trainer.evaluate(state, x, y))
    conv = [p for p in results[True][0] if p.endswith("weight") and results[True][0][p].dim() == 4]
    assert conv, "the test needs a convolutional model"
    for k, v in results[False][0].items():
        torch.testing.assert_close(results[True][0][k], v, rtol=1e-4, atol=1e-5)
    assert results[True][1][0] == results[False][1][0]


def test_trainer_uses_channels_last_for_conv_models_only():
    from edgepfl.training.trainer import Trainer

    assert Trainer(build_model("cnn2", (1, 28, 28), 10)).channels_last
    assert not Trainer(build_model("mlp", (1, 28, 28), 10)).channels_last


@pytest.mark.parametrize("name", list(MODELS))
def test_feature_tap_reads_the_features_the_logits_were_computed_from(name):
    """MOON and FedProto take ``features`` from the forward that made the logits; that
    holds only if every zoo model's forward is its last layer applied to ``features``."""
    from edgepfl.training.features import classifier_module, tap_features

    shape = (1, 8, 8) if name.startswith("cnn_small") else (3, 32, 32) if name == "cnn_cifar" \
        else (1, 28, 28)
    torch.manual_seed(0)
    model = build_model(name, shape, 10).eval()
    x = torch.randn(5, *shape)
    classifier = classifier_module(LayerSpec.from_model(model))
    with tap_features(model, classifier) as tap:
        logits = model(x)
        features = tap.take()
        # taken once: a stale value is never read for the next batch
        with pytest.raises(RuntimeError, match="did not pass through its classifier"):
            tap.take()
        assert torch.equal(features, model.features(x))
        assert torch.equal(logits, model.get_submodule(classifier)(features))
        tap.take()
    model(x)  # the hook is gone once the tap is closed
    with pytest.raises(RuntimeError):
        tap.take()
