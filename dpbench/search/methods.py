"""A method is a folder: ``<name>/pipeline.gin`` (its stages), ``<name>/method.json`` (its
paper, its claim, its search knobs per model family, how the board audits it) and
``<name>/README.md`` (its implementation notes, read off its paper).

dpbench's own methods live in the repository's ``pipelines/``; a researcher keeps theirs in any
folder of their own and names it in their protocol's ``method_dirs`` (or ``dpbench board
--methods_dirs``): sweep, board, audit and the tests find every method the same way, by its
folder, and its name is the folder's name. Its stage module can sit beside its pipeline.gin (a
gin ``import`` line finds it: the gin file's folder is importable, see ``config.parse_config``).

method.json (every key optional but ``paper``)::

    {"paper": "Yu et al., ICLR 2021",
     "claim": "+1.1 to +1.6 over DP-SGD on MNIST at epsilon 2 to 8 (Tab 1)",
     "claim_gain": [1.1, 1.6],      # the claim in points over DP-SGD (null: open end), or
                                    # {"<epsilon>": [lo, hi]}; the board's forest plot marks it
     "search": {"<family>" or "*": {"space": {...}, "exclude": [...], "trial0": [...],
                                    "trial0_is": "..."}},
     "audit": {"bindings": ["..."], "why": "..."} or {"skip": "why no canary audit applies"}}

``search`` holds, per model family of a protocol (``"*"``: any family without its own entry),
the method's own knobs on top of the family's shared space (docs/board-protocol.md).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BOARD_METHODS = REPO_ROOT / "pipelines"  # dpbench's own methods
PIPELINE_FILE, METHOD_FILE, README_FILE = "pipeline.gin", "method.json", "README.md"
METHOD_KEYS = {"paper", "claim", "claim_gain", "search", "audit", "about"}
SEARCH_KEYS = {"space", "exclude", "shared_as", "trial0", "trial0_is"}


class MethodError(ValueError):
    """A method folder dpbench cannot use; the message names the file and what to change."""


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    folder: Path
    paper: str
    claim: str = ""
    claim_gain: object = None  # [lo, hi] points over DP-SGD, or {"<epsilon>": [lo, hi]}
    search: dict = dataclasses.field(default_factory=dict)
    audit: dict = dataclasses.field(default_factory=dict)

    @property
    def gin_file(self) -> str:
        """Its pipeline file as runs name it: repo-relative for dpbench's own methods (records
        stay the same on every checkout), absolute for a researcher's."""
        path = (self.folder / PIPELINE_FILE).resolve()
        try:
            return str(path.relative_to(REPO_ROOT))
        except ValueError:
            return str(path)

    def search_entry(self, family: str) -> dict:
        """The protocol entry of this method in ``family``: its pipeline file and its knobs
        (the family's own entry, else ``"*"``). A method.json that lists knobs for other
        families but neither this one nor ``"*"`` is refused (MethodError): its own knobs would
        silently vanish from the search."""
        if self.search and family not in self.search and "*" not in self.search:
            raise MethodError(
                f"method {self.name!r} has no search knobs for family {family!r} (its "
                f"{METHOD_FILE} lists {sorted(self.search)}): add a {family!r} entry, or a "
                "\"*\" entry that any family without its own uses")
        knobs = self.search.get(family, self.search.get("*", {}))
        return {"gin_file": self.gin_file, **knobs}


def load_method(folder) -> Method:
    """The method in ``folder``, validated (its three files exist, method.json's keys known)."""
    folder = Path(folder)
    where = folder / METHOD_FILE
    missing = [f for f in (PIPELINE_FILE, METHOD_FILE, README_FILE) if not (folder / f).is_file()]
    if missing:
        raise MethodError(f"{folder}: a method folder holds {PIPELINE_FILE}, {METHOD_FILE} and "
                          f"{README_FILE}; missing {', '.join(missing)}")
    try:
        spec = json.loads(where.read_text())
    except json.JSONDecodeError as e:
        raise MethodError(f"{where}: not valid JSON ({e})") from e
    if not isinstance(spec, dict) or "paper" not in spec or set(spec) - METHOD_KEYS:
        raise MethodError(f"{where}: needs \"paper\" and only the keys {sorted(METHOD_KEYS)}; "
                          f"got {sorted(spec) if isinstance(spec, dict) else spec!r}")
    _check_claim_gain(where, spec.get("claim_gain"))
    for family, knobs in spec.get("search", {}).items():
        if not isinstance(knobs, dict) or set(knobs) - SEARCH_KEYS:
            raise MethodError(f"{where}: search.{family} takes only {sorted(SEARCH_KEYS)}; "
                              f"got {knobs!r}")
    return Method(name=folder.name, folder=folder, paper=spec["paper"],
                  claim=spec.get("claim", ""), claim_gain=spec.get("claim_gain"),
                  search=spec.get("search", {}),
                  audit=spec.get("audit", {}))


def _is_range(value) -> bool:
    return (isinstance(value, list) and len(value) == 2 and any(v is not None for v in value)
            and all(v is None or isinstance(v, (int, float)) and not isinstance(v, bool)
                    for v in value)
            and (None in value or value[0] <= value[1]))


def _check_claim_gain(where, gain) -> None:
    if gain is None or _is_range(gain) or isinstance(gain, dict) and gain and all(
            _is_float(k) and _is_range(v) for k, v in gain.items()):
        return
    raise MethodError(f"{where}: \"claim_gain\" is the paper's gain over DP-SGD in points, "
                      "[lo, hi] (null for an open end, e.g. [null, 0] for 'below DP-SGD'), or "
                      f"{{\"<epsilon>\": [lo, hi], ...}}; got {gain!r}")


def _is_float(text) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def claim_range(gain, epsilon: float):
    """The claimed (lo, hi) at ``epsilon`` (None: no numeric claim there)."""
    if isinstance(gain, dict):
        gain = next((v for k, v in gain.items() if float(k) == float(epsilon)), None)
    return None if gain is None else tuple(gain)


def discover(dirs=(BOARD_METHODS,)) -> dict:
    """name -> Method for every method folder directly under ``dirs`` (in order); a name found
    in two of them is refused (two methods would share the board's rows)."""
    found = {}
    for directory in dict.fromkeys(Path(d).resolve() for d in dirs):  # each folder once
        if not directory.is_dir():
            raise MethodError(f"{directory}: no such method folder directory")
        for folder in sorted(p for p in directory.iterdir() if (p / METHOD_FILE).is_file()):
            if folder.name in found:
                raise MethodError(f"method {folder.name!r} is in both {found[folder.name].folder}"
                                  f" and {folder}; rename one folder")
            found[folder.name] = load_method(folder)
    return found


def claims(dirs=(BOARD_METHODS,)) -> dict:
    """name -> {"paper", "claim", "claim_gain"}: what the board's verdicts print (and plot)
    next to each gain."""
    return {name: dict(paper=m.paper, claim=m.claim, claim_gain=m.claim_gain)
            for name, m in discover(dirs).items()}
