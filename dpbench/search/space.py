"""What each trial of a search binds: paired, quasirandom draws from the protocol's space.

Pairing. Per group, ONE sequence of points covers the family's shared space (every key of
``families.<family>.space``, in sorted order, one dimension each). Trial j >= 1 of every method
takes point j - 1 for the shared keys it keeps, so two methods' trial j differ only in their own
knobs and a gain can be read trial by trial. A method's own knobs (its ``space``) come from a
second sequence of its own; a key it redefines is its own (unpaired), one it ``exclude``s is not
bound, one it lists in ``shared_as`` is bound under its own name with the shared draw (GEP's
embedding bound takes the clip's draw).

Quasirandom. The points are scrambled Sobol points (scipy.stats.qmc), seeded from the
protocol's seed and the group's (and method's) name: a few trials still cover the space evenly,
as AlgoPerf's external tuning ruleset draws its trials. A unit coordinate u maps to a value by
the key's spec: ``choice`` -> choice[floor(u n)], ``uniform`` -> lo + u (hi - lo),
``log_uniform`` -> exp(log lo + u (log hi - log lo)), ``value`` -> the value.

Derived keys. A range may say ``"over": "<key>"`` or ``"times": "<key>"``: the draw is then the
product (or the ratio) and the binding is the draw divided (multiplied) by that key's value, e.g.
the learning rate drawn as the effective step lr x C, whose trajectory it sets when every example
is clipped. The referenced key must be a plain key of the same method's space (a shared key
by its family name or by the name ``shared_as`` gives it).
"""

from __future__ import annotations

import hashlib
import itertools
import math

import numpy as np
from scipy.stats import qmc

DERIVED = ("over", "times")


def stable_seed(*parts) -> np.random.SeedSequence:
    """A seed from the protocol's seed and names, stable across Python runs and machines."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return np.random.SeedSequence([int.from_bytes(digest[:8], "little")])


def unit_points(count: int, dims: int, seed: np.random.SeedSequence) -> np.ndarray:
    """``count`` scrambled Sobol points in [0, 1)^dims: the first ``count`` of a balanced
    2^m-point block (m the smallest with 2^m >= count)."""
    if dims == 0 or count == 0:
        return np.zeros((count, dims))
    sobol = qmc.Sobol(dims, scramble=True, seed=np.random.default_rng(seed))
    return sobol.random_base2(max(0, math.ceil(math.log2(count))))[:count]


def value_at(spec: dict, u: float):
    """The value of a key's spec at the unit coordinate ``u`` (4 significant digits for a
    range: readable bindings, still inside the declared range)."""
    if "value" in spec:
        return spec["value"]
    if "choice" in spec:
        choices = spec["choice"]
        return choices[min(int(u * len(choices)), len(choices) - 1)]
    lo, hi = spec.get("log_uniform") or spec["uniform"]
    if "log_uniform" in spec:
        value = math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))
    else:
        value = lo + u * (hi - lo)
    return float(f"{value:.4g}")


def _resolve(spec: dict, value, values: dict):
    if "over" in spec:
        return float(f"{value / values[spec['over']]:.4g}")
    if "times" in spec:
        return float(f"{value * values[spec['times']]:.4g}")
    return value


def method_space(protocol: dict, family: str, method: str) -> dict:
    """The space a method's trials are drawn from, under the names its runs bind: the family's
    shared keys (less ``exclude``, renamed by ``shared_as``) and its own knobs."""
    spec = protocol["families"][family]
    m = spec["methods"][method]
    rename = m.get("shared_as", {})
    shared = {rename.get(k, k): v for k, v in spec.get("space", {}).items()
              if k not in m.get("exclude", ()) and k not in m.get("space", {})}
    return {**shared, **m.get("space", {})}


def binding(key: str, value) -> str:
    """A gin binding; a string starting with '@' or '%' is a gin reference, written as is."""
    if isinstance(value, str) and value[:1] in ("@", "%"):
        return f"{key} = {value}"
    return f"{key} = {value!r}"


def _draw_values(protocol: dict, family: str, group: str, method: str, num_random: int,
                 rng: np.random.Generator | None = None):
    """Per random trial, {family or own key: value}: shared keys from the group's points (every
    method the same), own keys from the method's points, derived keys resolved last. With
    ``rng``: i.i.d. uniform points from it instead (a secret search, below)."""
    spec = protocol["families"][family]
    m = spec["methods"][method]
    own = m.get("space", {})
    shared_keys = sorted(spec.get("space", {}))
    own_keys = sorted(own)
    seed = protocol["trials"].get("seed", 0)
    if rng is None:
        shared_u = unit_points(num_random, len(shared_keys), stable_seed(seed, group, "shared"))
        own_u = unit_points(num_random, len(own_keys), stable_seed(seed, group, method, "own"))
    else:
        shared_u = rng.random((num_random, len(shared_keys)))
        own_u = rng.random((num_random, len(own_keys)))
    for j in range(num_random):
        specs, units = {}, {}
        for i, key in enumerate(shared_keys):
            if key not in own and key not in m.get("exclude", ()):
                specs[key], units[key] = spec["space"][key], shared_u[j, i]
        for i, key in enumerate(own_keys):
            specs[key], units[key] = own[key], own_u[j, i]
        values = {k: value_at(s, units[k]) for k, s in specs.items()}
        # a derived key may name a shared key by the method's own name for it
        values.update({m["shared_as"][k]: values[k] for k in m.get("shared_as", {})
                       if k in values})
        yield {k: _resolve(s, values[k], values) for k, s in specs.items()}


def trial_bindings(protocol: dict, family: str, group: str, method: str, num_random: int,
                   rng: np.random.Generator | None = None):
    """Bindings of trials 0..J, each after the family's ``base``: trial 0 the method's own
    recipe (``trial0``, default: its pipeline as is), then J paired draws (sorted keys, shared
    keys renamed by the method's ``shared_as``).

    ``rng`` (a secret search): the J draws are i.i.d. uniform from it, unpaired. Why: Papernot
    & Steinke's bound needs every random trial to be the same randomized mechanism; a public
    quasirandom sequence would make trial j's configuration name j, so a released winner would
    reveal a lower bound on the secret J."""
    spec = protocol["families"][family]
    m = spec["methods"][method]
    base = list(spec.get("base", []))
    rename = m.get("shared_as", {})
    out = [base + list(m.get("trial0", []))]
    for values in _draw_values(protocol, family, group, method, num_random, rng):
        named = {rename.get(k, k): v for k, v in values.items()}
        out.append(base + [binding(k, named[k]) for k in sorted(named)])
    return out


def privacy_support(protocol: dict, family: str, method: str) -> list:
    """Every combination of the space's privacy-relevant values, as lists of bindings."""
    space = method_space(protocol, family, method)
    keys = sorted(k for k, v in space.items() if v.get("privacy"))
    values = [space[k]["choice"] if "choice" in space[k] else [space[k]["value"]] for k in keys]
    base = list(protocol["families"][family].get("base", []))
    return [base + [binding(k, v) for k, v in zip(keys, combo)]
            for combo in itertools.product(*values)]


def privacy_key(bindings, protocol: dict, family: str, method: str) -> tuple:
    """The privacy-relevant part of a random trial's bindings: which support point it is."""
    space = method_space(protocol, family, method)
    keys = {k for k, v in space.items() if v.get("privacy")}
    return tuple(sorted(b for b in bindings if b.split(" = ")[0] in keys))


def shared_draw(bindings, protocol: dict, family: str, method: str) -> dict:
    """A random trial's values of the family's shared keys that the method keeps from the
    group's points, under the family's names: equal across methods for the same trial j."""
    m = protocol["families"][family]["methods"][method]
    rename = m.get("shared_as", {})
    bound = dict(b.split(" = ", 1) for b in bindings)
    return {k: bound[rename.get(k, k)] for k in protocol["families"][family].get("space", {})
            if k not in m.get("space", {}) and k not in m.get("exclude", ())
            and rename.get(k, k) in bound}
