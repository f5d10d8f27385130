"""The house's rules that the import linter does not state: no import cycle anywhere in fedfeat (imports inside
functions count), and the plugin-facing names stay where the docs say."""

from __future__ import annotations

import grimp


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    mods = sorted(graph.modules)
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in mods:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = counter[0]
                counter[0] += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def test_cycle_finder_finds_a_planted_cycle():
    g = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c"):
        g.add_module(m)
    g.add_import(importer="p.a", imported="p.b")
    g.add_import(importer="p.b", imported="p.c")
    g.add_import(importer="p.c", imported="p.a")
    assert _cycles(g) == [["p.a", "p.b", "p.c"]]


def test_no_import_cycle_in_fedfeat():
    graph = grimp.build_graph("fedfeat")
    assert len(graph.modules) > 50
    assert _cycles(graph) == []


def test_the_public_api_resolves_to_the_modules_that_define_it():
    import fedfeat
    from fedfeat.engine.rounds import run_federated
    from fedfeat.methods.head import LinearHead
    from fedfeat.partition.make import make_partition

    for name in fedfeat.__all__:
        assert getattr(fedfeat, name) is not None, name
    assert fedfeat.LinearHead is LinearHead and fedfeat.make_partition is make_partition
    assert fedfeat.run_federated is run_federated
