"""pFedBayes (Zhang et al., "Personalized Federated Learning via Variational Bayesian
Inference", ICML 2022): the flat (server + clients) Bayesian pFL method.

Per weight coordinate, mean-field Gaussians with sigma = softplus(rho) = log(1 + exp(rho)):

* the server holds the global distribution p_w(theta) = N(mu, sigma^2);
* client i keeps its personalized distribution q_i(theta) = N(mu_i, sigma_i^2) between
  rounds (it never leaves the client) and minimises the paper's objective, per sample:

      Omega_i(q_i) = E_{q_i}[ mean NLL of its data ] + zeta / n_i * KL(q_i || p_w)

  i.e. the whole data set's negative ELBO (the sum over its n_i samples plus zeta * KL)
  divided by n_i. The data term is estimated on each mini-batch with ``train_mc``
  reparameterized draws theta = mu_i + sigma_i * eps, eps ~ N(0, I);
* after each personal step the client moves its *local copy* of the global distribution
  (started from the downloaded p_w) towards q_i, one step on zeta / n_i * KL(q_i || p_w)
  over (mu, rho) with its own learning rate (Algorithm 1), and uploads that copy;
* the server mixes: (mu, rho) <- (1 - beta) (mu, rho) + beta * mean of the uploads
  (beta = 1: the plain average of the selected clients').

The reparameterization gradient is taken by the chain rule, not autograd: a draw is copied
into the trainer's module skeleton, the stock forward/backward gives g = dL/dtheta, and
dL/dmu_i = g, dL/drho_i = g * eps * sigmoid(rho_i). The KL terms have closed-form
gradients (``kl_grads``). Clients step with Adam (the reference code's optimizer, lr 0.001
for both distributions; its moments are reset every round, where the reference code keeps
them across rounds) or plain SGD; under SGD the KL's
quadratic term in the means, of precision zeta / (n_i sigma^2), is far stiffer than the
data term when sigma is small, so it is stepped implicitly (its proximal map, as hierbayes'
pull) unless ``pull = "explicit"``. docs/algorithms.md has the details and the defaults.
"""

from __future__ import annotations

from typing import ClassVar, Literal, cast

import torch
import torch.nn.functional as F
from pydantic import Field

from edgepfl.contract.algorithm import (
    Algorithm,
    Client,
    ClientContext,
    Hyperparameters,
    LogUniform,
    PrivacySupport,
    Reporter,
    SearchRange,
    Server,
    ServerContext,
    State,
    UpdateResult,
)
from edgepfl.contract.kit import check_model_reply, num_samples
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message, MessageError
from edgepfl.federation.rng import generator
from edgepfl.training.client_data import ClientData
from edgepfl.training.device import host, to_device
from edgepfl.training.pulls import AdamDirection

MU, RHO = "mu.", "rho."


class PFedBayesHyperparameters(Hyperparameters):
    # the KL weight and the personal rate (the paper's zeta and eta)
    search_space: ClassVar[dict[str, SearchRange]] = {
        "zeta": LogUniform(0.01, 10.0),
        "personal_lr": LogUniform(1e-4, 1e-2),
    }
    # train.lr: the Gaussians step at personal_lr and global_lr
    not_searched: ClassVar[tuple[str, ...]] = ("train.lr",)
    zeta: float = Field(0.1, ge=0, description="weight of KL(q_i || global) against the whole "
                        "data set's NLL (the paper's zeta: 10 at its sigma_0 = softplus(-2.5); "
                        "0.1 keeps about its pull zeta / sigma_0^2 at our rho_init = -5)")
    rho_init: float = Field(-5.0, ge=-30, le=5, description="initial rho of every coordinate, "
                            "global and personal: sigma = softplus(rho) (-5: sigma = 0.0067)")
    optimizer: Literal["adam", "sgd"] = Field(
        "adam", description="how clients step their Gaussians: adam (the reference code's "
        "torch Adam; moments reset every round, the reference keeps them) or plain sgd")
    personal_lr: float = Field(1e-3, gt=0, description="learning rate of the personal q_i "
                               "(the paper's eta = 0.001; train.lr is not used)")
    global_lr: float = Field(1e-3, gt=0, description="learning rate of the client's local "
                             "copy of the global distribution (the reference code's 0.001)")
    personal_steps: int = Field(1, ge=1, description="steps on q_i per mini-batch before the "
                                "global copy's step (reference code: 5, pFedMe's K)")
    train_mc: int = Field(1, ge=1, description="reparameterized draws per step for the data "
                          "term (the paper's K)")
    beta: float = Field(1.0, gt=0, description="server mixing: (1 - beta) old + beta * mean of "
                        "the uploads (1: plain averaging)")
    weighting: Literal["uniform", "samples"] = Field(
        "uniform", description="the uploads' mean: uniform over the selected clients (the "
        "paper's 1/S) or weighted by sample count (the pFedMe-derived reference code)")
    pull: Literal["implicit", "explicit"] = Field(
        "implicit", description="with optimizer = sgd, how the KL's quadratic term in the "
        "means is stepped: implicit (its proximal map, stable for any lr * zeta / (n sigma^2)) "
        "or explicit (a plain gradient step)")
    mc_samples: int = Field(4, ge=1, description="Monte Carlo draws of each predictive "
                            "(personal and global) at evaluation")
    personalize: Literal["kept", "fit"] = Field(
        "kept", description="what a client is scored on: kept = the personal q_i it keeps "
        "between rounds (the paper's; a client never selected keeps its initial q_i); fit "
        "= a q_i fitted at test time from the current global distribution, held fixed, for "
        "personal_epochs on its training data (hierbayes' protocol)")
    personal_epochs: int = Field(1, ge=1, description="epochs of the test-time fit under "
                                 "personalize = fit (part of the evaluation protocol)")


# -- the closed-form pieces (elementwise on flat tensors) ---------------------------------
def softplus(rho: torch.Tensor) -> torch.Tensor:
    """sigma = log(1 + exp(rho)), as the paper parameterizes the standard deviations."""
    return F.softplus(rho)


def kl(mu_q: torch.Tensor, rho_q: torch.Tensor, mu_p: torch.Tensor,
       rho_p: torch.Tensor) -> torch.Tensor:
    """KL(N(mu_q, sigma_q^2) || N(mu_p, sigma_p^2)) per coordinate (sigma = softplus(rho))."""
    s_q, s_p = softplus(rho_q), softplus(rho_p)
    return torch.log(s_p / s_q) + (s_q ** 2 + (mu_q - mu_p) ** 2) / (2 * s_p ** 2) - 0.5


def kl_grads(mu_q: torch.Tensor, rho_q: torch.Tensor, mu_p: torch.Tensor, rho_p: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``kl`` with respect to (mu_q, rho_q, mu_p, rho_p), written so that no
    intermediate leaves float32's range down to sigma ~ 1e-13 (rho = -30)."""
    s_q, s_p = softplus(rho_q), softplus(rho_p)
    prec = 1.0 / s_p ** 2
    d = mu_q - mu_p
    g_mu_q = prec * d
    # dKL/dsigma_q = sigma_q prec - 1/sigma_q,  dsigma/drho = sigmoid(rho)
    g_rho_q = (s_q ** 2 * prec - 1.0) * (torch.sigmoid(rho_q) / s_q)
    # dKL/dsigma_p = 1/sigma_p - (sigma_q^2 + d^2) / sigma_p^3
    g_rho_p = (1.0 - (s_q ** 2 + d ** 2) * prec) * (torch.sigmoid(rho_p) / s_p)
    return g_mu_q, g_rho_q, -g_mu_q, g_rho_p


def personal_grads(mu: torch.Tensor, rho: torch.Tensor, g_mu: torch.Tensor, g_rho: torch.Tensor,
                   prior_mu: torch.Tensor, prior_rho: torch.Tensor,
                   coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients over q_i = N(mu, softplus(rho)^2) of  data + coef * KL(q_i || prior), given
    the data term's (g_mu, g_rho)."""
    k_mu, k_rho, _, _ = kl_grads(mu, rho, prior_mu, prior_rho)
    return g_mu + coef * k_mu, g_rho + coef * k_rho


def global_grads(mu: torch.Tensor, rho: torch.Tensor, q_mu: torch.Tensor, q_rho: torch.Tensor,
                 coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients over the global copy N(mu, softplus(rho)^2) of  coef * KL(q || it)."""
    _, _, k_mu, k_rho = kl_grads(q_mu, q_rho, mu, rho)
    return coef * k_mu, coef * k_rho


class SGD:
    """x <- x - lr g; with ``prec`` (the precision of a quadratic term inside g) the step is
    scaled by 1 / (1 + lr prec), which makes it the quadratic's implicit (proximal) step:
    (x - lr g_rest + lr prec anchor) / (1 + lr prec) for g = g_rest + prec (x - anchor)."""

    def __init__(self, lr: float):
        self.lr = lr

    def step(self, x: torch.Tensor, g: torch.Tensor,
             prec: torch.Tensor | None = None) -> torch.Tensor:
        if prec is not None:
            g = g / (1 + self.lr * prec)
        return x.add(g, alpha=-self.lr)  # the trainer's arithmetic


class Adam:
    """torch.optim.Adam's update (no weight decay) on one flat tensor; a fresh one per round.
    ``prec`` is ignored: Adam takes the explicit gradient, as the reference code does."""

    def __init__(self, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.lr = lr
        self.direction = AdamDirection(betas, eps)

    def step(self, x: torch.Tensor, g: torch.Tensor,
             prec: torch.Tensor | None = None) -> torch.Tensor:
        d = g.clone()
        self.direction([d])
        return x - self.lr * d


# -- flat <-> per-parameter -----------------------------------------------------------------
def _flat(model: State, names: list[str]) -> torch.Tensor:
    return torch.cat([model[n].reshape(-1) for n in names])


def _unflat(flat: torch.Tensor, like: State, names: list[str], prefix: str = "") -> State:
    out, i = {}, 0
    for n in names:
        t = like[n]
        out[prefix + n] = host(flat[i:i + t.numel()].reshape(t.shape))
        i += t.numel()
    return out


def _split(tensors: State, prefix: str) -> State:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def _check_buffers(buffers, where: str) -> None:
    if buffers:
        raise ConfigError(f"pfedbayes puts a Gaussian on every weight; model buffers "
                          f"{list(buffers)} (BatchNorm) have no place in it: choose a model "
                          f"without BatchNorm ({where})")


# -- the two parts ---------------------------------------------------------------------------
class PFedBayesServer(Server, Reporter):
    state = ("mu", "rho", "round")

    def __init__(self, ctx: ServerContext, hp: PFedBayesHyperparameters):
        super().__init__(ctx, hp)
        _check_buffers(ctx.layers.buffers, "server")
        if ctx.train.momentum:
            raise ConfigError("pfedbayes steps its Gaussians with plain SGD; train.momentum "
                              f"= {ctx.train.momentum} is not supported (set it to 0)")
        self.mu: State = {k: v.clone() for k, v in ctx.init_model.items()}
        self.rho: State = {k: torch.full_like(v, hp.rho_init) for k, v in ctx.init_model.items()}
        self.round = 0

    def _message(self, meta: dict | None = None) -> Message:
        return Message({**{MU + k: v for k, v in self.mu.items()},
                        **{RHO + k: v for k, v in self.rho.items()}}, meta or {})

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Message]:
        msg = self._message()
        return {cid: msg for cid in selected}

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        self.round = rnd
        if not replies:
            return
        weights = []
        for cid, reply in replies.items():
            n = num_samples(cid, reply)
            weights.append(float(n) if self.hp.weighting == "samples" else 1.0)
        total = sum(weights)
        if total == 0:
            return
        beta = self.hp.beta
        for part, prefix in ((self.mu, MU), (self.rho, RHO)):
            for k, old in part.items():
                mean = sum(w / total * r.tensors[prefix + k] for w, r in zip(weights, replies.values(),
                                                                            strict=True))
                part[k] = mean if beta == 1 else (1 - beta) * old + beta * mean

    def check_reply(self, cid: int, reply: Message) -> None:
        # its copy of the global distribution, as it was sent
        check_model_reply(cid, reply, self._message().tensors)

    def eval_message(self, cid: int) -> Message | None:
        return self._message({"round": self.round})

    def round_metrics(self) -> dict[str, float]:
        sigma = torch.cat([softplus(r).reshape(-1) for r in self.rho.values()])
        return {"global_std": float(sigma.mean())}


class PFedBayesClient(Client):
    def __init__(self, ctx: ClientContext, hp: PFedBayesHyperparameters):
        super().__init__(ctx, hp)
        _check_buffers(ctx.trainer.buffers, "client")
        self.names = list(ctx.trainer.param_names)
        self.shapes = [ctx.trainer.params[n].shape for n in self.names]

    def init_state(self, cid: int, init_model: State) -> State:
        return {**{MU + k: v.clone() for k, v in init_model.items()},
                **{RHO + k: torch.full_like(v, self.hp.rho_init) for k, v in init_model.items()}}

    def _distribution(self, tensors: State, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        mu, rho = _split(tensors, MU), _split(tensors, RHO)
        if set(mu) != set(self.names) or set(rho) != set(self.names):
            raise MessageError(f"pfedbayes {what} needs {MU}<param> and {RHO}<param> for "
                               f"exactly the model's parameters {self.names}")
        return _flat(mu, self.names), _flat(rho, self.names)

    def _load_draw(self, theta: torch.Tensor) -> None:
        """A flat weight vector into the trainer's skeleton."""
        params = self.trainer.params
        with torch.no_grad():
            i = 0
            for n, shape in zip(self.names, self.shapes, strict=True):
                p = params[n]
                p.copy_(theta[i:i + p.numel()].view(shape))
                i += p.numel()

    def _data_grads(self, mu: torch.Tensor, rho: torch.Tensor, xb: torch.Tensor,
                    yb: torch.Tensor, noise: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, float]:
        """The mini-batch's mean NLL under ``train_mc`` draws theta = mu + sigma * eps and its
        gradients with respect to (mu, rho), by the reparameterization's chain rule."""
        trainer, k = self.trainer, self.hp.train_mc
        params = [trainer.params[n] for n in self.names]
        sigma, dsigma = softplus(rho), torch.sigmoid(rho)
        g_mu, g_rho, loss_sum = torch.zeros_like(mu), torch.zeros_like(rho), 0.0
        for _ in range(k):
            # drawn on the CPU: the same stream whatever the trainer's device
            eps = torch.randn(mu.shape, generator=noise, dtype=mu.dtype).to(mu.device)
            self._load_draw(mu + sigma * eps)
            for p in params:
                p.grad = None
            loss = F.cross_entropy(trainer.model(xb), yb)
            loss.backward()
            g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                           for p in params])
            g_mu += g
            g_rho += g * eps
            loss_sum += float(loss.detach())
        for p in params:
            p.grad = None
        g_mu /= k
        g_rho *= dsigma / k
        return g_mu, g_rho, loss_sum / k

    def _optimizers(self) -> dict[str, SGD | Adam]:
        hp = self.hp
        return {name: (Adam(lr) if hp.optimizer == "adam" else SGD(lr))
                for name, lr in (("mu_i", hp.personal_lr), ("rho_i", hp.personal_lr),
                                 ("mu_g", hp.global_lr), ("rho_g", hp.global_lr))}

    def _batches(self, data: ClientData, epochs: int, gen: torch.Generator):
        """``epochs`` of the client's mini-batches on the trainer's device, the skeleton in
        training mode; its loaded state is forgotten before and after (draws overwrite it)."""
        self.trainer.forget()
        self.trainer.model.train()
        for _ in range(epochs):
            for xb, yb in data.batches(self.ctx.train.batch_size, gen):
                yield self.trainer.layout(xb), to_device(yb, self.trainer.device)
        self.trainer.forget()

    def _personal_step(self, opt: dict[str, SGD | Adam], mu_i: torch.Tensor,
                       rho_i: torch.Tensor, mu_g: torch.Tensor, rho_g: torch.Tensor,
                       coef: float, xb: torch.Tensor, yb: torch.Tensor,
                       noise: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One step of q_i = (mu_i, rho_i) on Omega_i under the global (mu_g, rho_g)."""
        hp, t = self.hp, self.ctx.train
        g_mu, g_rho, loss = self._data_grads(mu_i, rho_i, xb, yb, noise)
        if t.weight_decay:
            g_mu = g_mu + t.weight_decay * mu_i
        g_mu, g_rho = personal_grads(mu_i, rho_i, g_mu, g_rho, mu_g, rho_g, coef)
        implicit = hp.optimizer == "sgd" and hp.pull == "implicit"
        prec = coef / softplus(rho_g) ** 2 if implicit else None
        return opt["mu_i"].step(mu_i, g_mu, prec), opt["rho_i"].step(rho_i, g_rho), loss

    def update(self, cid: int, msg: Message, state: State, data: ClientData,
               gen: torch.Generator) -> UpdateResult:
        hp, t = self.hp, self.ctx.train
        mu_g, rho_g = self._distribution(msg.tensors, "message")
        mu_i, rho_i = self._distribution(state, "client state")
        mu_g, rho_g, mu_i, rho_i = self.trainer.place([mu_g, rho_g, mu_i, rho_i])
        coef = hp.zeta / max(data.n, 1)
        opt = self._optimizers()
        implicit = hp.optimizer == "sgd" and hp.pull == "implicit"
        # the draws come from their own stream, seeded from the client's generator without
        # consuming it: the mini-batch order is then exactly that of local training
        noise = generator(gen.initial_seed(), "pfedbayes-noise")
        loss_sum, seen, steps = 0.0, 0, 0
        for xb, yb in self._batches(data, t.local_epochs, gen):
            for _ in range(hp.personal_steps):
                mu_i, rho_i, loss = self._personal_step(opt, mu_i, rho_i, mu_g, rho_g, coef,
                                                        xb, yb, noise)
                steps += 1
            g_mu, g_rho = global_grads(mu_g, rho_g, mu_i, rho_i, coef)
            prec = coef / softplus(rho_g) ** 2 if implicit else None
            mu_g = opt["mu_g"].step(mu_g, g_mu, prec)
            rho_g = opt["rho_g"].step(rho_g, g_rho)
            loss_sum += loss * yb.numel()  # the data term at the batch's last personal step
            seen += yb.numel()
        like = {n: self.trainer.params[n] for n in self.names}
        state = {**_unflat(mu_i, like, self.names, MU), **_unflat(rho_i, like, self.names, RHO)}
        reply = Message({**_unflat(mu_g, like, self.names, MU),
                         **_unflat(rho_g, like, self.names, RHO)}, {"num_samples": data.n})
        stats = {"train_loss": loss_sum / max(seen, 1), "steps": float(steps),
                 "samples": float(seen)}
        return UpdateResult(reply, state, stats)

    def _test_time_fit(self, cid: int, rnd: int, mu_g: torch.Tensor, rho_g: torch.Tensor,
                       data: ClientData) -> tuple[torch.Tensor, torch.Tensor]:
        """personalize = fit: q_i from the global distribution, personal_epochs of personal
        steps on the client's training data under that global, which stays fixed."""
        hp = self.hp
        mu_g, rho_g = self.trainer.place([mu_g, rho_g])
        mu_i, rho_i = mu_g.clone(), rho_g.clone()
        coef = hp.zeta / max(data.n, 1)
        opt = self._optimizers()
        gen = generator(self.ctx.seed, "personalize", rnd, cid)
        noise = generator(self.ctx.seed, "personalize-noise", rnd, cid)
        for xb, yb in self._batches(data, hp.personal_epochs, gen):
            for _ in range(hp.personal_steps):
                mu_i, rho_i, _ = self._personal_step(opt, mu_i, rho_i, mu_g, rho_g, coef,
                                                     xb, yb, noise)
        return host(mu_i), host(rho_i)

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        """The personal distribution's mean."""
        return {k: state[MU + k] for k in self.names}

    def predictive(self, cid: int, state: State, eval_msg: Message | None,
                   data: ClientData) -> dict[str, list[State]]:
        rnd = cast(int, eval_msg.meta.get("round", 0)) if eval_msg is not None else 0
        mu_i, rho_i = self._distribution(state, "client state")
        if eval_msg is not None:
            mu, rho = self._distribution(eval_msg.tensors, "evaluation message")
            if self.hp.personalize == "fit" and rnd > 0:
                mu_i, rho_i = self._test_time_fit(cid, rnd, mu, rho, data)
        out = {"": self._draws(mu_i, rho_i, generator(self.ctx.seed, "mc", rnd))}
        if eval_msg is not None:
            # one global predictive for every client: the same draws everywhere
            out["global"] = self._draws(mu, rho, generator(self.ctx.seed, "mc-global", rnd))
        return out

    def new_client_model(self, cid: int, state: State, msg: Message | None, data: ClientData,
                         epochs: int, gen: torch.Generator) -> list[State]:
        """A newcomer has no personal posterior kept: q_i fitted from the global
        distribution at test time (personalize = fit, whatever the trained clients do),
        personal_epochs, then its MC draws (``eval.new_client_epochs`` does not apply)."""
        if msg is None:
            raise MessageError("a new pfedbayes client is fitted from the global distribution, "
                               "but none was given")
        rnd = cast(int, msg.meta.get("round", 0))
        mu, rho = self._distribution(msg.tensors, "new-client message")
        mu_i, rho_i = self._test_time_fit(cid, rnd, mu, rho, data)
        return self._draws(mu_i, rho_i, generator(self.ctx.seed, "mc", rnd))

    def _draws(self, mu: torch.Tensor, rho: torch.Tensor, gen: torch.Generator) -> list[State]:
        like = {n: self.trainer.params[n] for n in self.names}
        sigma = softplus(rho)
        return [_unflat(mu + sigma * torch.randn(mu.shape, generator=gen, dtype=mu.dtype),
                        like, self.names) for _ in range(self.hp.mc_samples)]


ALGORITHM = Algorithm(
    name="pfedbayes",
    summary="pFedBayes: personal Gaussian posteriors under a global Gaussian prior, "
            "zeta-weighted KL, reparameterized training, MC prediction (flat star)",
    hyperparameters=PFedBayesHyperparameters,
    server=PFedBayesServer,
    client=PFedBayesClient,
    paper="Zhang et al., Personalized Federated Learning via Variational Bayesian Inference, "
          "ICML 2022",
    privacy=PrivacySupport(
        refused="client level: the server aggregates posterior means and variances, not model "
        "updates; sample level: its variational training runs outside the engine's DP-SGD trainer"),
)
