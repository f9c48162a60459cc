"""Replica groups. A replica given as `URL#label` (`--replica http://10.0.0.7:8000#canary`) is in
the group `label`: it takes only the traffic sent to that group (a canary's share, a shadow's
copies). Replicas given without a label, and those found through DNS, are the main group, which
takes everything else."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from lockgate.router.pool import split_url
from lockgate.router.replica import Replica

MAIN = ""  # the group of replicas without a label
_LABEL = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def label_of(url: str) -> str:
    """The group a replica URL names after `#` ('' for none); ValueError for a bad label."""
    label = urllib.parse.urlsplit(url if "://" in url else f"http://{url}").fragment
    if label and not _LABEL.fullmatch(label):
        raise ValueError(f"replica {url!r}: a group label is 1-64 of A-Z a-z 0-9 _ . -")
    return label


def check_label(label: str, option: str) -> str:
    if not _LABEL.fullmatch(label):
        raise ValueError(f"{option}: group {label!r} must be 1-64 of A-Z a-z 0-9 _ . -")
    return label


def replica_url(url: str) -> str:
    """The URL as the pool names the replica: http://host:port, without the label."""
    host, port = split_url(url)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


@dataclass(frozen=True, slots=True)
class ReplicaGroups:
    labels: dict[str, str] = field(default_factory=dict)  # replica URL -> its group

    @classmethod
    def of_urls(cls, urls: Iterable[str]) -> ReplicaGroups:
        return cls({replica_url(url): label for url in urls if (label := label_of(url))})

    @property
    def names(self) -> set[str]:
        return set(self.labels.values())

    def group(self, replica: Replica) -> str:
        return self.labels.get(replica.url, MAIN)

    def members(self, replicas: Sequence[Replica], group: str) -> Sequence[Replica]:
        if not self.labels:
            return replicas if group == MAIN else []
        return [r for r in replicas if self.labels.get(r.url, MAIN) == group]
