"""Namespace colours: a look per namespace, none repeated among those on one screen."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.access.roles import Role
from controlplane.dashboard.looks import LOOKS, look_class, namespace_looks, preferred_look
from tests.dashboard.builders import gpu_container, make_node, pod, signed_in

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=20)


@given(st.sets(names, max_size=LOOKS))
def test_up_to_24_namespaces_never_share_a_look(namespaces: set[str]) -> None:
    looks = namespace_looks(namespaces)
    assert set(looks) == namespaces
    assert len(set(looks.values())) == len(namespaces)
    assert all(0 <= v < LOOKS for v in looks.values())


@given(st.sets(names, max_size=40), st.randoms())
def test_the_looks_depend_on_the_set_not_its_order(namespaces: set[str], rng) -> None:
    shuffled = list(namespaces)
    rng.shuffle(shuffled)
    assert namespace_looks(shuffled) == namespace_looks(sorted(namespaces))


def test_a_namespace_without_a_rival_keeps_its_look_on_every_screen() -> None:
    alone = preferred_look("team-a")
    others = [n for n in (f"ns-{i}" for i in range(200)) if preferred_look(n) != alone][:10]
    assert namespace_looks(["team-a"])["team-a"] == alone
    assert namespace_looks(["team-a", *others])["team-a"] == alone


def test_two_namespaces_that_prefer_one_look_get_two() -> None:
    first = "team-a"
    rival = next(
        n for n in (f"ns-{i}" for i in range(1000)) if preferred_look(n) == preferred_look(first)
    )
    looks = namespace_looks([first, rival])
    assert looks[first] != looks[rival]
    # the 8 hues of the old palette alone made 1 in 8 pairs share a colour: here no pair does
    assert look_class(looks[first]) != look_class(looks[rival])


def test_past_24_namespaces_looks_repeat_but_every_one_has_one() -> None:
    many = [f"ns-{i}" for i in range(30)]
    looks = namespace_looks(many)
    assert set(looks) == set(many) and len(set(looks.values())) == LOOKS


@pytest.mark.django_db
def test_the_nodes_page_gives_its_namespaces_distinct_looks_in_bars_and_legend() -> None:
    make_node("n1", cards=4, memory_mib=81920)
    # namespaces chosen to collide in the 8-hue palette the page used before
    base = "team-a"
    rival = next(
        n
        for n in (f"ns-{i}" for i in range(1000))
        if preferred_look(n) % 8 == preferred_look(base) % 8
        and preferred_look(n) != preferred_look(base)
    )
    same = next(
        n for n in (f"ns-{i}" for i in range(1000)) if preferred_look(n) == preferred_look(base)
    )
    for i, ns in enumerate((base, rival, same)):
        pod(f"p{i}", "n1", gpu_container("app", mem=1024, cores=10), namespace=ns)
    body = signed_in(Role.VIEWER).get("/nodes/").content.decode()
    seg = {
        ns: re.search(rf'class="seg (h\d p\d)" data-width="[\d.]+" data-pod="{ns}/', body).group(1)
        for ns in (base, rival, same)
    }
    assert len(set(seg.values())) == 3, seg
    legend = body[body.index('class="nslegend"') :]
    for ns, css in seg.items():
        assert f'<i class="swatch {css}"></i>{ns}</span>' in legend
