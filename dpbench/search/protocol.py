"""The tuning protocol FILE: its schema, read and checked before anything trains or is written
(every error names the file and the key, and says what to change). What the protocol MEANS
(trial counts, the search's epsilon) is ``dpbench.search.tuning``.

Schema (JSON; docs/board-protocol.md has a complete 20-line example)::

    {"delta": 1e-5, "epsilons": [3.0, 1.0], "seeds": [0, 1, 2],
     "trials": {"shape": "inf", "mean_random": 5, "seed": 1}   # K = 1 + J, J ~ the law
               or {"fixed": K, "seed": 1,                       # exactly K (the board:
                   "deployment": {"shape": "inf", "mean_random": 7}},  # K is public anyway)
     "method_dirs": ["my_methods"],          # optional; relative to this file; then pipelines/
     "families": {"<dataset>__<model>": {
         "gin_files": ["gin/data/...", "gin/model/..."],   # after each method's pipeline.gin
         "base": ["train.x = 1"],                          # bindings of every trial
         "space": {"<gin key>": {"log_uniform": [lo, hi]} | {"uniform": [lo, hi]}
                                | {"choice": [...]} | {"value": x},   # + "privacy": true,
                   ...},               # "over"/"times": "<key>" (derived), "source": "why",
                                       # "at_epsilon": {"1.0": [lo, hi]} or {"1.0":
                                       # {"range": [lo, hi], "source": "why"}} (a range's
                                       # own range for the groups at that target epsilon)
         "methods": ["dpsgd", "mine"]}}}      # method folders (dpbench.search.methods)

A method may also be given inline, ``"methods": {"name": {"gin_file": ..., "space": ...}}``;
a method's entry (its folder's method.json, per family) may ``exclude`` shared keys, bind one
under its own name (``"shared_as": {"<shared key>": "<its key>"}``) and add or redefine keys in
its own ``space`` (how trials are drawn and paired: ``dpbench.search.space``).
A space key that changes a run's DpEvent (batch size, epochs) must say ``"privacy": true`` and
take finitely many values; the search's epsilon takes the worst of them.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from dpbench.search import methods

SPEC_KINDS = ("log_uniform", "uniform", "choice", "value")
# space keys that always change a run's DpEvent: they must be declared "privacy": true
DP_EVENT_KEYS = ("train.batch_size", "train.epochs")
# the keys each level may hold: a typo ("exlude", "spcae") is refused, never silently ignored
# "analysis": the board's registered analysis (search/registration.py), relative to the protocol
PROTOCOL_KEYS = {"delta", "epsilons", "seeds", "trials", "families", "method_dirs", "about",
                 "analysis"}
FAMILY_KEYS = {"gin_files", "base", "space", "methods", "about", "space_is", "base_is"}
INLINE_METHOD_KEYS = {"gin_file", "about"} | methods.SEARCH_KEYS
TRIAL_COUNT_KEYS = ("shape", "mean_random", "seed")


class ProtocolError(ValueError):
    """A protocol file dpbench cannot run; the message says what to change."""


SPEC_EXTRAS = ("privacy", "over", "times", "source", "at_epsilon")


def _check_spec(where: str, key: str, spec) -> None:
    kinds = [k for k in SPEC_KINDS if isinstance(spec, dict) and k in spec]
    if len(kinds) != 1 or set(spec) - {kinds[0], *SPEC_EXTRAS}:
        raise ProtocolError(f"{where}: {key} must be one of {{'log_uniform': [lo, hi]}}, "
                            "{'uniform': [lo, hi]}, {'choice': [...]} or {'value': x}, with an "
                            "optional \"privacy\": true, \"over\" / \"times\": \"<key>\", "
                            "\"at_epsilon\": {\"<epsilon>\": [lo, hi]} "
                            f"and \"source\": \"...\"; got {spec!r}")
    kind = kinds[0]
    if kind in ("log_uniform", "uniform"):
        for at, (lo, hi) in [("", spec[kind])] + [
                (f" at epsilon {e}", _range_of(r)) for e, r in spec.get("at_epsilon", {}).items()]:
            if not (lo < hi) or (kind == "log_uniform" and lo <= 0):
                raise ProtocolError(f"{where}: {key} range{at} {[lo, hi]} must be [lo, hi] "
                                    f"with lo < hi{' and lo > 0' if kind == 'log_uniform' else ''}")
    elif "at_epsilon" in spec:
        raise ProtocolError(f"{where}: {key}: \"at_epsilon\" gives a range per target epsilon; "
                            f"it needs a log_uniform or uniform range, not {kind!r}")
    if kind == "choice" and not spec["choice"]:
        raise ProtocolError(f"{where}: {key} has no choices")
    if key in DP_EVENT_KEYS and not spec.get("privacy"):
        raise ProtocolError(f"{where}: {key} changes the run's DpEvent (its sampling rate or "
                            "step count): declare it with \"privacy\": true so the search's "
                            "epsilon covers every value it can take")
    if spec.get("privacy") and (kind not in ("choice", "value") or "over" in spec
                                or "times" in spec):
        raise ProtocolError(f"{where}: {key} changes the run's DpEvent (\"privacy\": true), so "
                            "it must be a finite 'choice' or a 'value': the search's epsilon "
                            "takes the maximum over every value it can take")
    if ("over" in spec or "times" in spec) and (kind not in ("log_uniform", "uniform")
                                                or "over" in spec and "times" in spec):
        raise ProtocolError(f"{where}: {key}: \"over\" or \"times\" (one of them) derives a "
                            "range's value from another key's; it needs a log_uniform or "
                            "uniform range")


def _check_derived(where: str, specs: dict, names: dict) -> None:
    """A derived key ("over"/"times") of ``specs`` names a plain key of ``names`` (the same
    method's keys, a shared one also by its ``shared_as`` name)."""
    for key, spec in specs.items():
        other = spec.get("over", spec.get("times"))
        if other is None:
            continue
        if other not in names or "over" in names[other] or "times" in names[other]:
            raise ProtocolError(f"{where}: {key} is drawn {'over' if 'over' in spec else 'times'}"
                                f" {other!r}, which is not a plain key this method draws (add "
                                f"it to the space, or stop excluding it)")


def _resolve_methods(path: Path, protocol: dict) -> None:
    """A family's ``methods`` as a list of names -> each method folder's entry (its pipeline
    file and its knobs for that family), found under the protocol's ``method_dirs`` (relative
    to the protocol file) and then dpbench's own ``pipelines/``. An entry given inline as
    {"gin_file": ..., ...} is kept as is. A family gin file found beside the protocol is named
    by its full path (trials run from the repository's root)."""
    extra = protocol.get("method_dirs", [])
    if not isinstance(extra, list):
        raise ProtocolError(f"{path}: 'method_dirs' must be a list of folders, got {extra!r}")
    dirs = [path.parent / d for d in extra] + [methods.BOARD_METHODS]
    dirs = list(dict.fromkeys(d.resolve() for d in dirs))
    for family, spec in protocol["families"].items():
        # a family's own gin file beside the protocol (a researcher's folder) by its full path:
        # trials run from the repository's root
        if "gin_files" in spec:
            spec["gin_files"] = [str((path.parent / f).resolve()) if (path.parent / f).is_file()
                                 else f for f in spec["gin_files"]]
        if isinstance(spec.get("methods"), list):
            try:
                found = methods.discover(dirs)
            except methods.MethodError as e:
                raise ProtocolError(f"{path}: {e}") from e
            unknown = [m for m in spec["methods"] if m not in found]
            if unknown:
                near = {m: difflib.get_close_matches(m, list(found), n=1) for m in unknown}
                hint = "".join(f"did you mean {close[0]!r} for {m!r}? "
                               for m, close in near.items() if close)
                raise ProtocolError(
                    f"{path}: family {family}: no method folder {unknown} under "
                    f"{', '.join(map(str, dirs))}; {hint}for a method of your own, add its "
                    "folder's parent to 'method_dirs'")
            try:
                spec["methods"] = {m: found[m].search_entry(family) for m in spec["methods"]}
            except methods.MethodError as e:
                raise ProtocolError(f"{path}: family {family}: {e}") from e


def _check_random_law(path: Path, law: dict, where: str, keys=TRIAL_COUNT_KEYS) -> None:
    missing = [k for k in keys if k not in law]
    if missing or law["mean_random"] < 1 or not (
            law["shape"] == "inf" or isinstance(law["shape"], (int, float))
            and law["shape"] >= 0):
        raise ProtocolError(f"{path}: {where} needs shape >= 0 (0 logarithmic, 1 geometric, "
                            "\"inf\" Poisson), mean_random >= 1"
                            + (" and seed" if "seed" in keys else "") + ", or {\"fixed\": K}; "
                            f"missing {missing or 'nothing'}, got {law}")


def _check_trial_law(path: Path, trials: dict) -> None:
    if "fixed" in trials:
        k = trials["fixed"]
        if set(trials) - {"fixed", "why", "seed", "deployment"} or isinstance(k, bool) \
                or not isinstance(k, int) or k < 1:
            raise ProtocolError(f"{path}: 'trials': {{\"fixed\": K}} takes one integer K >= 1 "
                                f"(every method runs exactly K trials; an optional 'seed' seeds "
                                f"the draws, an optional 'deployment' law the secret-K epsilon), "
                                f"got {trials}")
        if "deployment" in trials:
            law = trials["deployment"]
            if not isinstance(law, dict) or set(law) - {"shape", "mean_random", "why"}:
                raise ProtocolError(f"{path}: 'trials.deployment' is a law "
                                    "{\"shape\": ..., \"mean_random\": ...} (J drawn in "
                                    f"secret by a deployment), got {law!r}")
            _check_random_law(path, law, "'trials.deployment'", ("shape", "mean_random"))
        return
    _check_random_law(path, trials, "'trials'")


def _check_method_space(where: str, family: dict, m: dict) -> None:
    """The method's specs under the family's names (what its draws resolve against)."""
    rename = m.get("shared_as", {})
    if not isinstance(rename, dict) or set(rename) - set(family.get("space", {})):
        raise ProtocolError(f"{where}: shared_as maps the family's shared keys to the method's "
                            f"names; {rename!r} names keys the family's space lacks")
    specs = {k: v for k, v in family.get("space", {}).items()
             if k not in m.get("exclude", ()) and k not in m.get("space", {})}
    aliases = {rename[k]: specs[k] for k in rename if k in specs}
    specs = {**specs, **m.get("space", {})}
    _check_derived(where, specs, {**aliases, **specs})


def _check_at_epsilon(where: str, key: str, spec: dict, epsilons) -> None:
    """Each "at_epsilon" entry names one of the protocol's epsilons (a typo such as "0.1" for
    1.0 would otherwise be a range that silently never applies) with a [lo, hi] pair."""
    entries = spec.get("at_epsilon", {}) if isinstance(spec, dict) else {}
    if not isinstance(entries, dict):
        raise ProtocolError(f"{where}: {key}: \"at_epsilon\" maps a target epsilon to its "
                            f"[lo, hi] range, e.g. {{\"1.0\": [0.05, 0.8]}}; got {entries!r}")
    for name, pair in entries.items():
        try:
            epsilon = float(name)
        except ValueError:
            epsilon = None
        if epsilon not in [float(e) for e in epsilons]:
            raise ProtocolError(f"{where}: {key}: \"at_epsilon\" names {name!r}, not one of "
                                f"the protocol's epsilons {epsilons}")
        if isinstance(pair, dict) and (set(pair) - {"range", "source"} or "range" not in pair):
            raise ProtocolError(f"{where}: {key}: the range at epsilon {name} is [lo, hi] or "
                                f"{{\"range\": [lo, hi], \"source\": \"why\"}}, got {pair!r}")
        if not (isinstance(_range_of(pair), list) and len(_range_of(pair)) == 2):
            raise ProtocolError(f"{where}: {key}: the range at epsilon {name} must be [lo, hi]"
                                f", got {pair!r}")


def _range_of(entry):
    """An "at_epsilon" entry's [lo, hi]: the entry itself, or its "range"."""
    return entry.get("range") if isinstance(entry, dict) else entry


def at_epsilon(protocol: dict, epsilon: float) -> dict:
    """The protocol as its groups at ``epsilon`` run it: a range with an "at_epsilon" entry
    for ``epsilon`` takes that range, and no spec keeps "at_epsilon" (what a group's
    search.json stores is the space in force there, so a range added for one epsilon leaves
    the other epsilons' groups exactly as they were). An entry's "source" replaces the
    range's own there."""
    def resolve(space: dict) -> dict:
        out = {}
        for key, spec in space.items():
            spec = {k: v for k, v in spec.items() if k != "at_epsilon"}
            for name, entry in space[key].get("at_epsilon", {}).items():
                if float(name) == float(epsilon):
                    kind = "log_uniform" if "log_uniform" in spec else "uniform"
                    spec[kind] = list(_range_of(entry))
                    if isinstance(entry, dict) and "source" in entry:
                        spec["source"] = entry["source"]
            out[key] = spec
        return out

    families = {}
    for family, spec in protocol["families"].items():
        spec = dict(spec, methods={m: (dict(e, space=resolve(e["space"])) if "space" in e
                                       else e) for m, e in spec["methods"].items()})
        families[family] = dict(spec, space=resolve(spec["space"])) if "space" in spec else spec
    return dict(protocol, families=families)


def _check_keys(where: str, entry, known: set) -> None:
    if not isinstance(entry, dict):
        raise ProtocolError(f"{where}: expected an object with keys among {sorted(known)}, "
                            f"got {entry!r}")
    unknown = sorted(set(entry) - known)
    if unknown:
        raise ProtocolError(f"{where}: unknown keys {unknown}; the known ones are "
                            f"{', '.join(sorted(known))}")


def load_protocol(path) -> dict:
    """The protocol file, validated (every error names the file and the key), with each
    family's methods resolved to their entries."""
    path = Path(path)
    try:
        protocol = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ProtocolError(f"{path}: unreadable protocol ({e})") from e
    for key in ("delta", "epsilons", "seeds", "trials", "families"):
        if key not in protocol:
            raise ProtocolError(f"{path}: missing '{key}'")
    _check_keys(f"{path}", protocol, PROTOCOL_KEYS)
    for family, spec in protocol["families"].items():
        _check_keys(f"{path}: family {family}", spec, FAMILY_KEYS)
        if isinstance(spec.get("methods"), dict):  # inline entries (folders are checked apart)
            for method, m in spec["methods"].items():
                _check_keys(f"{path}: family {family} method {method}", m, INLINE_METHOD_KEYS)
    _check_trial_law(path, protocol["trials"])
    _resolve_methods(path, protocol)
    for family, spec in protocol["families"].items():
        where = f"{path}: family {family}"
        for key, value in spec.get("space", {}).items():
            _check_at_epsilon(where, key, value, protocol["epsilons"])
            _check_spec(where, key, value)
        if not spec.get("methods"):
            raise ProtocolError(f"{where}: no methods")
        for method, m in spec["methods"].items():
            if "gin_file" not in m:
                raise ProtocolError(f"{where}: method {method} needs a 'gin_file' (or list the "
                                    "family's methods by name, each a method folder)")
            for key, value in m.get("space", {}).items():
                _check_at_epsilon(f"{where} method {method}", key, value, protocol["epsilons"])
                _check_spec(f"{where} method {method}", key, value)
            _check_method_space(f"{where} method {method}", spec, m)
    return protocol
