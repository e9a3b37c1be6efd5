"""What the embedded corpus is made of: source releases pinned by name, version and sha256, and the checksums
of the corpus built from them.

The corpus is the documentation shipped in the source distributions of a few permissively licensed Python
projects (their reStructuredText / text manuals, without changelogs), plus, as out-of-distribution text, the
license texts shipped in the same archives. Changing anything here, or how ``embedded.py`` turns archives into
documents, changes the bytes: bump ``CORPUS_VERSION`` and the checksums together.
"""

from __future__ import annotations

from dataclasses import dataclass

CORPUS_VERSION = 3
#: files whose path hash falls below this go to the held-out split (every chunk of a file on one side)
HELDOUT_FRACTION = 0.05


@dataclass(frozen=True)
class Source:
    """One source distribution: where its documents are inside the archive and what license covers them.

    ``documents`` and ``exclude`` are glob patterns (``fnmatch``, ``*`` crosses folders) on member paths
    relative to the archive's top folder; ``ood`` lists single files taken whole as out-of-distribution text.
    """

    name: str
    version: str
    sha256: str
    license: str
    documents: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    ood: tuple[str, ...] = ()

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


SOURCES: tuple[Source, ...] = (
    Source(
        "django", "5.2.8", "23254866a5bb9a2cfa6004e8b809ec6246eba4b58a7589bc2772f1bcc8456c7f", "BSD-3-Clause",
        documents=("docs/*.txt",), exclude=("docs/releases/*", "docs/_*"), ood=("LICENSE.python",),
    ),
    Source(
        "sqlalchemy", "2.0.44", "0ae7454e1ab1d780aee69fd2aae7d6b8670a581d8847f2d1e0f7ddfbf47e5a22", "MIT",
        documents=("doc/build/*.rst",), exclude=("doc/build/changelog/*",),
    ),
    Source(
        "sphinx", "8.2.3", "398ad29dee7f63a75888314e9424d40f52ce5a6a87ae88e7071e80af296ec348", "BSD-2-Clause",
        documents=("doc/*.rst",), exclude=("doc/changes/*", "doc/_*"),
    ),
    Source(
        "docutils", "0.21.2", "3a6b18732edf182daa3cd12775bbb338cf5691468f91eeeb109deff6ebfa986f",
        "Public-Domain AND BSD-2-Clause (docs: public domain)",
        documents=("docs/*.txt",), ood=("licenses/gpl-3-0.txt", "COPYING.txt"),
    ),
    Source(
        "sympy", "1.14.0", "d3d3fe8df1e5a0b42f0e7bdf50541697dbe7d23746e894990c030e2b05e72517", "BSD-3-Clause",
        documents=("doc/src/*.rst", "doc/src/*.md"), exclude=("doc/src/_*",), ood=("LICENSE",),
    ),
    Source(
        "pytest", "8.4.2", "86c0d0b93306b961d58d62a4db4879f27fe25513d4b969df351abdddb3c30e01", "MIT",
        documents=("doc/en/*.rst",), exclude=("doc/en/changelog.rst", "doc/en/announce/*", "doc/en/_*"),
    ),
    Source(
        "requests", "2.32.5", "dbba0bac56e100853db0ea71b82b4dfd5fe2bf6d3754a8893c3af500cec7d7cf", "Apache-2.0",
        ood=("LICENSE",),
    ),
)

#: sha256 of the canonical JSON-lines form of the whole corpus (every split, in order)
CORPUS_SHA256 = "f9321013d1d7f746fcb7b74cd2cdeb80bac5fa382237e501f41f555ce007d31d"
#: sha256 of each split's canonical JSON lines
SPLIT_SHA256 = {
    "train": "ef6e0e9e18dadddb37f60c5d9bfe2adfa8ffe51b3060040fdf715d9b6e7c59c1",
    "heldout": "d81c211962276d96683a9ca77f9a4ed8499431dc03f13689d16d795ea92cf6ec",
    "ood": "ed2834f7ccaf40aa622548c0c82a50117a106440ac92afc92072f37d8571bf41",
}
