"""Shell completion, two ways in:

* kubectl's plugin completion (kubectl >= 1.26): on TAB after `kubectl snapshot`, kubectl runs
  `kubectl_complete-snapshot ARG... INCOMPLETE` (cli/main.py's `complete`) from PATH and reads one
  candidate per line (optionally `VALUE<TAB>DESCRIPTION`) and a last line `:DIRECTIVE` (cobra's
  ShellCompDirective). pip installs that command; the krew archive ships it as a script running
  `kubectl snapshot __complete ...`.
* `kubectl snapshot completion bash|zsh|fish` prints a script completing the `kubectl-snapshot` command
  itself (click's completion, driven by $_KUBECTL_SNAPSHOT_COMPLETE).

Dynamic values (pods, PodSnapshots, namespaces, contexts, nodes) are read from the cluster with the
flags already typed (--kubeconfig, --context, -n); any failure just offers nothing.
"""

from __future__ import annotations

from typing import Any

import click
from click.shell_completion import CompletionItem, ShellComplete, get_completion_class

from kubectl_snapshot.app.ports import Kube
from kubectl_snapshot.cli import wiring

COMPLETE_VAR = "_KUBECTL_SNAPSHOT_COMPLETE"
PROG = "kubectl-snapshot"
SHELLS = ("bash", "zsh", "fish")

# cobra's ShellCompDirective bits
DIRECTIVE_DEFAULT = 0  # the shell may complete file names
DIRECTIVE_NO_SPACE = 2
DIRECTIVE_NO_FILES = 4
DIRECTIVE_DIRS = 16


def _kube(ctx: click.Context) -> tuple[Kube, str]:
    kube = wiring.kube_client(ctx)
    return kube, wiring.namespace_of(kube, ctx)


def _names(items: list[dict[str, Any]], prefix: str, incomplete: str) -> list[CompletionItem]:
    names = sorted(str((o.get("metadata") or {}).get("name") or "") for o in items)
    return [CompletionItem(prefix + n) for n in names if n and (prefix + n).startswith(incomplete)]


def pods(ctx: click.Context, _param: click.Parameter | None, incomplete: str) -> list[CompletionItem]:
    """`pod/NAME` for the running pods of the namespace."""
    try:
        kube, ns = _kube(ctx)
        running = kube.list_pods(ns, field_selector="status.phase=Running")
    except Exception:  # completion never fails loudly
        return []
    return _names(running, "pod/", incomplete)


def snapshots(ctx: click.Context, _param: click.Parameter | None, incomplete: str) -> list[CompletionItem]:
    try:
        kube, ns = _kube(ctx)
        items = kube.list_snapshots(ns)
    except Exception:
        return []
    return _names(items, "", incomplete)


def namespaces(ctx: click.Context, _param: click.Parameter | None, incomplete: str) -> list[CompletionItem]:
    try:
        kube, _ns = _kube(ctx)
        items = kube.list_namespaces()
    except Exception:
        return []
    return _names(items, "", incomplete)


def nodes(ctx: click.Context, _param: click.Parameter | None, incomplete: str) -> list[CompletionItem]:
    try:
        kube, _ns = _kube(ctx)
        items = kube.list_nodes()
    except Exception:
        return []
    return _names(items, "", incomplete)


def contexts(ctx: click.Context, _param: click.Parameter | None, incomplete: str) -> list[CompletionItem]:
    try:
        from kubectl_snapshot.adapters.kube import kubeconfig_contexts

        names = kubeconfig_contexts(wiring.kube_opts(ctx).kubeconfig)
    except Exception:
        return []
    return [CompletionItem(n) for n in names if n.startswith(incomplete)]


def candidates(cli: click.Command, args: list[str]) -> tuple[list[tuple[str, str]], int]:
    """(value, help) candidates for the last of `args` (the word being completed) and a cobra directive."""
    words, incomplete = (args[:-1], args[-1]) if args else ([], "")
    comp = ShellComplete(cli, {}, "kubectl snapshot", COMPLETE_VAR)
    items = comp.get_completions(words, incomplete)
    if any(i.type == "file" for i in items):
        return [], DIRECTIVE_DEFAULT
    if any(i.type == "dir" for i in items):
        return [], DIRECTIVE_DIRS
    directive = DIRECTIVE_NO_FILES
    if any(i.value.endswith("=") for i in items):  # -o jsonpath=: the template follows without a space
        directive |= DIRECTIVE_NO_SPACE
    return [(str(i.value), str(i.help or "").splitlines()[0] if i.help else "") for i in items], directive


def cobra_output(cli: click.Command, args: list[str]) -> str:
    items, directive = candidates(cli, args)
    lines = [f"{v}\t{h}" if h else v for v, h in items]
    return "".join(line + "\n" for line in lines) + f":{directive}\n"


def source(cli: click.Command, shell: str) -> str:
    """The completion script for `kubectl-snapshot` in `shell`."""
    cls = get_completion_class(shell)
    if cls is None:
        raise click.BadParameter(f"{shell!r} is not one of {', '.join(SHELLS)}")
    return str(cls(cli, {}, PROG, COMPLETE_VAR).source())
