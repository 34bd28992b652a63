"""A generative model of a board, fitted to a board's committed records (board v3's: 4 groups x
8 methods x (8 trials + 4 retrains)), from which whole boards are simulated
(board/design_study.py).

Per group, in the unit coordinates of the family's shared search space (the lr x C draw and C
on their log scales; the batch, epochs and EMA choices as levels):

- DP-SGD's mean accuracy: mu_0(x) = f(x) + e_0(x): a quadratic surface f in the two
  continuous coordinates plus the choices' level effects (least squares on every paired
  method's seed-0 trials, each with its own offset), and a configuration's own term e_0,
  i.i.d. N(0, tau_0^2), for what the surface misses (tau_0 from DP-SGD's residuals).
- Each method m: mu_m(x) = mu_0(x) + a_m + s_m (mu_0(x) - mbar) + e_m(x), mbar DP-SGD's mean
  over the space's law: a_m is the method's mean gain over the space (the paired estimand),
  s_m how its gain moves with DP-SGD's accuracy, e_m i.i.d. N(0, tau_m^2) per configuration
  (its own knobs, its own failures). Moments of the paired differences give them, corrected
  for the seed noise on both sides (errors in variables). A method drawing from a space of its
  own (Nasr et al.) is mbar + a_m + e_m.
- A run: test = mu_m(x) + N(0, sigma_t^2), validation = mu_m(x) + delta_m + N(0, sigma_v^2),
  independent (their covariance across seeds of one configuration is ~0 on v3: 0.002-0.034
  against variances of 0.03-0.11), sigma_t and sigma_v pooled over the group's retrains;
  test accuracies are counts over 10,000 test images (multiples of 0.01 points).

The model's parameters are plain JSON (:meth:`BoardModel.as_json`), so a study states what it
simulated.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
from scipy.stats import qmc

BASELINE = "dpsgd"
CLIP_KEYS = ("clip.global_l2.l2_bound", "gep.embed_and_clip.embedding_bound")
LR_KEY, CLIP_KEY = "optimize.optax.learning_rate", "clip.global_l2.l2_bound"
LEVEL_KEYS = ("train.batch_size", "train.epochs", "train.ema_decay")
TEST_EXAMPLES = 10_000


@dataclasses.dataclass(frozen=True)
class Space:
    """The shared space's two continuous coordinates (log lr x C, log C: their ranges) and its
    choices' levels (a key with one level is a constant)."""

    lr_c: tuple
    clip: tuple
    levels: dict

    @classmethod
    def of(cls, spec: dict) -> "Space":
        space = spec["space"]
        levels = {k: list(space[k]["choice"]) if "choice" in space[k] else [space[k]["value"]]
                  for k in LEVEL_KEYS if k in space}
        return cls(tuple(space[LR_KEY]["log_uniform"]), tuple(space[CLIP_KEY]["log_uniform"]),
                   levels)

    def coordinates(self, lr: float, clip: float, settings: dict) -> np.ndarray:
        """A configuration's unit coordinates: (u, v, level indices...)."""
        def unit(x, bounds):
            lo, hi = (math.log(b) for b in bounds)
            return (math.log(x) - lo) / (hi - lo)
        levels = [self.levels[k].index(settings[k]) if settings[k] in self.levels[k] else 0
                  for k in self.levels]
        return np.array([unit(lr * clip, self.lr_c), unit(clip, self.clip), *levels], float)

    def draw(self, count: int, rng: np.random.Generator) -> np.ndarray:
        """``count`` points of the space's law as the search draws them: scrambled Sobol in
        the unit cube, the choices by floor(u x levels)."""
        dims = 2 + len(self.levels)
        u = qmc.Sobol(dims, scramble=True, seed=rng).random_base2(
            max(0, math.ceil(math.log2(max(count, 1)))))[:count]
        sizes = np.array([len(v) for v in self.levels.values()])
        u[:, 2:] = np.minimum(np.floor(u[:, 2:] * sizes), sizes - 1)
        return u

    def features(self, points: np.ndarray) -> np.ndarray:
        """The surface's regressors: 1, u, v, u^2, v^2, uv and one indicator per non-first level
        of each choice that has more than one."""
        u, v = points[:, 0], points[:, 1]
        cols = [np.ones(len(points)), u, v, u * u, v * v, u * v]
        for i, values in enumerate(self.levels.values()):
            cols += [(points[:, 2 + i] == level).astype(float) for level in range(1, len(values))]
        return np.stack(cols, axis=1)


@dataclasses.dataclass(frozen=True)
class GroupModel:
    """One group's fitted model (see the module docstring); accuracies in points."""

    name: str
    space: Space
    beta: np.ndarray          # the surface's coefficients on Space.features
    fbar: float               # DP-SGD's mean accuracy over the space's law (mbar)
    methods: dict             # method -> dict(a, s, tau, delta, own_space, trial0)
    sigma_test: float
    sigma_val: float

    def surface(self, points: np.ndarray) -> np.ndarray:
        return self.space.features(points) @ self.beta

    def baseline(self, points: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """mu_0 at ``points``: the surface plus one configuration term per point."""
        return self.surface(points) + self.methods[BASELINE]["tau"] * rng.standard_normal(
            len(points))

    def means(self, method: str, base: np.ndarray, rng: np.random.Generator,
              shift: float = 0.0, heterogeneous: bool = True,
              offsets: bool = True) -> np.ndarray:
        """mu_m where DP-SGD's means are ``base`` (the same configurations; for a method with a
        space of its own, DP-SGD's means at that method's points): the model's relation plus
        ``shift``; ``heterogeneous=False``: DP-SGD's means plus ``shift`` exactly;
        ``offsets=False``: the relation with a_m = 0 (no mean gain over the space)."""
        if method == BASELINE or not heterogeneous:
            return base + shift
        m = self.methods[method]
        a = m["a"] if offsets else 0.0
        if m["own_space"]:
            return self.fbar + a + shift + m["tau"] * rng.standard_normal(len(base))
        return (base + a + shift + m["s"] * (base - self.fbar)
                + m["tau"] * rng.standard_normal(len(base)))

    def as_json(self) -> dict:
        return dict(name=self.name, space=dataclasses.asdict(self.space),
                    beta=[float(b) for b in self.beta], fbar=self.fbar, methods=self.methods,
                    sigma_test=self.sigma_test, sigma_val=self.sigma_val)


def _binding_values(bindings) -> dict:
    out = {}
    for b in bindings:
        key, _, value = b.partition("=")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def record_config(record: dict) -> tuple:
    """(lr, clip bound, {batch, epochs, ema}) a run trained with, from its record."""
    options = {s["name"]: s for s in record["stages"]}
    clip = next(options[n][k] for n, k in (("clip.global_l2", "l2_bound"),
                                           ("gep.embed_and_clip", "embedding_bound"))
                if n in options)
    return (options["optimize.optax"]["learning_rate"], clip,
            {"train.batch_size": record["batch_size"], "train.epochs": record["epochs"],
             "train.ema_decay": record["ema_decay"]})


def read_group(group_dir: Path) -> dict:
    """method -> dict(points [K, d], test [K], val [K], winner, seeds: [(test, val)] of the
    winner's runs (seed 0 first), own_space) in points, from a group's search.json and
    records."""
    plan = json.loads((group_dir / "search.json").read_text())
    space = Space.of(plan["family_spec"])
    out = {}
    for method in plan["methods"]:
        rows = []
        for t in range(plan["num_trials"]):
            record = json.loads((group_dir / f"{method}-t{t}-seed0" /
                                 "run_record.json").read_text())
            lr, clip, settings = record_config(record)
            rows.append((space.coordinates(lr, clip, settings), 100 * record["test_accuracy"],
                         100 * record["validation_accuracy"]))
        val = [r[2] for r in rows]
        winner = int(np.argmax(val))
        seeds = []
        for s in plan["seeds"]:
            path = group_dir / f"{method}-t{winner}-seed{s}" / "run_record.json"
            if path.exists():
                r = json.loads(path.read_text())
                seeds.append((100 * r["test_accuracy"], 100 * r["validation_accuracy"]))
        spec = plan["family_spec"]["methods"].get(method, {})
        own = any(k in spec.get("space", {}) for k in (LR_KEY, CLIP_KEY))
        out[method] = dict(points=np.stack([r[0] for r in rows]),
                           test=np.array([r[1] for r in rows]), val=np.array(val),
                           winner=winner, seeds=np.array(seeds), own_space=own)
    return dict(space=space, methods=out)


def _noise(data: dict) -> tuple:
    """Pooled within-configuration seed sd of test and of validation (the winners' runs)."""
    vt, vv, dof = 0.0, 0.0, 0
    for m in data.values():
        if len(m["seeds"]) >= 2:
            vt += np.var(m["seeds"][:, 0], ddof=1) * (len(m["seeds"]) - 1)
            vv += np.var(m["seeds"][:, 1], ddof=1) * (len(m["seeds"]) - 1)
            dof += len(m["seeds"]) - 1
    return math.sqrt(vt / dof), math.sqrt(vv / dof)


def _space_mean(space: Space, beta: np.ndarray) -> float:
    points = space.draw(4096, np.random.default_rng(0))
    return float(np.mean(space.features(points) @ beta))


def _surface(space: Space, methods: dict, ridge: float) -> np.ndarray:
    """f's coefficients: least squares on every paired method's seed-0 trials, each method
    with its own offset (the offsets are not kept)."""
    paired = [m for m in methods if not methods[m]["own_space"]]
    blocks, targets = [], []
    for i, m in enumerate(paired):
        X = space.features(methods[m]["points"])
        offsets = np.zeros((len(X), len(paired) - 1))
        if i > 0:
            offsets[:, i - 1] = 1.0
        blocks.append(np.concatenate([X, offsets], axis=1))
        targets.append(methods[m]["test"])
    A, y = np.concatenate(blocks), np.concatenate(targets)
    penalty = ridge * np.eye(A.shape[1])
    penalty[0, 0] = 0.0
    return np.linalg.solve(A.T @ A + penalty, A.T @ y)[:space.features(
        methods[BASELINE]["points"][:1]).shape[1]]


def _relative(base: np.ndarray, mine: np.ndarray, sigma_t: float, mbar: float) -> dict:
    """a, s, tau of mu_m = mu_0 + a + s (mu_0 - mbar) + e from paired observations (both
    carry seed noise of variance sigma_t^2: the moments are corrected for it)."""
    d = mine - base
    true_var = max(np.var(base, ddof=1) - sigma_t ** 2, 1e-6)
    s = (np.cov(d, base)[0, 1] + sigma_t ** 2) / true_var
    s = float(np.clip(s, -0.9, 3.0))
    tau2 = np.var(d, ddof=1) - s * s * true_var - 2 * sigma_t ** 2
    a = float(np.mean(d) - s * (np.mean(base) - mbar))
    return dict(a=a, s=s, tau=float(math.sqrt(max(tau2, 0.0))))


def fit_group(name: str, group_dir: Path, ridge: float = 1e-3) -> GroupModel:
    """The group's model (see the module docstring)."""
    data = read_group(group_dir)
    space, methods = data["space"], data["methods"]
    sigma_t, sigma_v = _noise(methods)
    beta = _surface(space, methods, ridge)
    base = methods[BASELINE]
    resid = base["test"] - space.features(base["points"]) @ beta
    tau0 = math.sqrt(max(np.sum(resid ** 2) / (len(resid) - 1) - sigma_t ** 2, 0.0))
    mbar = _space_mean(space, beta)
    fitted = {}
    for m, d in methods.items():
        if m == BASELINE:
            rel = dict(a=0.0, s=0.0, tau=tau0)
        elif d["own_space"]:
            rel = dict(a=float(np.mean(d["test"]) - mbar), s=-1.0, tau=float(math.sqrt(max(
                np.var(d["test"], ddof=1) - sigma_t ** 2, 0.0))))
        else:
            rel = _relative(base["test"], d["test"], sigma_t, mbar)
        fitted[m] = dict(rel, delta=float(np.mean(d["seeds"][:, 1] - d["seeds"][:, 0])),
                         own_space=bool(d["own_space"]),
                         trial0=[float(x) for x in d["points"][0]])
    return GroupModel(name, space, beta, mbar, fitted, sigma_t, sigma_v)


@dataclasses.dataclass(frozen=True)
class BoardModel:
    groups: dict  # group name -> GroupModel

    def as_json(self) -> dict:
        return {name: g.as_json() for name, g in sorted(self.groups.items())}


def fit_board(records_dir) -> BoardModel:
    """Every group of a board's records (a folder holding search.json) fitted."""
    root = Path(records_dir)
    return BoardModel({d.name: fit_group(d.name, d) for d in sorted(root.iterdir())
                       if (d / "search.json").is_file()})


def round_to_test_set(accuracy_points: np.ndarray) -> np.ndarray:
    """Accuracies as counts over the test set (multiples of 100 / TEST_EXAMPLES points)."""
    return np.rint(accuracy_points * TEST_EXAMPLES / 100.0) * (100.0 / TEST_EXAMPLES)


def simulate_arm(group: GroupModel, method: str, base: np.ndarray, retrains: int,
                 rng: np.random.Generator, shift: float = 0.0,
                 heterogeneous: bool = True, offsets: bool = True) -> dict:
    """One method's search at the configurations where DP-SGD's means are ``base`` (trial 0,
    the recipe, first) and its winner's ``retrains`` seeds: val, test (points), the winner,
    the retrains' tests, and every trial's true mean accuracy (``mu``)."""
    mu = group.means(method, base, rng, shift, heterogeneous, offsets)
    delta = group.methods[method]["delta"]
    test = round_to_test_set(mu + group.sigma_test * rng.standard_normal(len(mu)))
    val = mu + delta + group.sigma_val * rng.standard_normal(len(mu))
    winner = int(np.argmax(val))
    seeds = round_to_test_set(mu[winner] + group.sigma_test * rng.standard_normal(retrains))
    return dict(val=val, test=test, winner=winner, retrains=seeds, mu=mu)
