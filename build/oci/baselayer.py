"""The runtime base as the image's first layer(s), edited as a file tree instead of by RUN steps.

Each layer of the base image is copied entry by entry, with three edits:
  * setuid and setgid bits are cleared on every file, in the base layer itself (a later layer
    that chmods them would carry a second copy of each binary), so the training user has no
    way up;
  * pip's bootstrap wheels (usr/share/python-wheels) are dropped: nothing installs into the
    image;
  * extended attributes, file capabilities among them, are dropped.
The last layer also gets the training user: its lines in passwd, group, shadow and gshadow
(the shadow day is the base's own day), a home folder with /etc/skel's files, and /workspace,
both owned by the user. Nothing runs to make these edits, and each added entry carries the
base's own time, so the layer depends on the base and the user spec alone.

The base's layers are input like any other: a member named outside the root (absolute, or
through `..`), a hard link to nothing the layers so far hold, or an account or skeleton file
over READ_CAP (it is edited in memory) is refused with the base named, before it is written.
"""
from __future__ import annotations

import datetime
import io
import json
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from build.errors import BuildFailure
from build.oci.layercache import CachedLayer, LayerCache, layer_key
from build.oci.tarlayer import DIR_MODE, FILE_MODE, LayerBlob, LayerWriter, Owner, TreeEntry

DROPPED = ("usr/share/python-wheels",)
ACCOUNT_FILES = ("etc/passwd", "etc/group", "etc/shadow", "etc/gshadow")
XATTR_PREFIXES = ("SCHILY.xattr.", "LIBARCHIVE.xattr.", "SCHILY.acl.")
# The account and skeleton files are held in memory to be edited: a real one is a few KiB.
READ_CAP = 16 << 20


@dataclass(frozen=True)
class TrainingUser:
    name: str
    uid: int
    gid: int

    @property
    def home(self) -> str:
        return f"home/{self.name}"


def base_epoch(config: dict) -> int:
    """The base's own time: its config's `created` (a bootstrapped base's is its Release date)."""
    created = str(config.get("created") or "")
    try:   # to the second: engines print up to nanoseconds, which datetime does not parse
        stamp = datetime.datetime.strptime(created[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=datetime.UTC)
    except ValueError:
        raise BuildFailure(f"the runtime base's config has no usable `created` time ({created[:40]!r})",
                           "use a bootstrapped base, or a registry base with an RFC 3339 `created`") from None
    return int(stamp.timestamp())


def account_lines(user: TrainingUser, day: int) -> dict[str, str]:
    return {"etc/passwd": f"{user.name}:x:{user.uid}:{user.gid}::/home/{user.name}:/bin/bash\n",
            "etc/group": f"{user.name}:x:{user.gid}:\n",
            "etc/shadow": f"{user.name}:!:{day}:0:99999:7:::\n",
            "etc/gshadow": f"{user.name}:!::\n"}


def add_account(path: str, text: str, user: TrainingUser, line: str) -> str:
    """`text` with the user's line appended; a name or id already taken is a build failure."""
    for existing in text.splitlines():
        fields = existing.split(":")
        if fields[0] == user.name:
            raise BuildFailure(f"the runtime base already has {user.name!r} in /{path}",
                               "choose another runtime.user in image.yaml")
        if path == "etc/passwd" and len(fields) > 2 and fields[2] == str(user.uid):
            raise BuildFailure(f"uid {user.uid} is already {fields[0]!r} in the runtime base's /etc/passwd",
                               "choose another runtime.uid in image.yaml")
        if path == "etc/group" and len(fields) > 2 and fields[2] == str(user.gid):
            raise BuildFailure(f"gid {user.gid} is already {fields[0]!r} in the runtime base's /etc/group",
                               "choose another runtime.gid in image.yaml")
    return (text if text.endswith("\n") or not text else text + "\n") + line


def _dropped(name: str) -> bool:
    return any(name == d or name.startswith(d + "/") for d in DROPPED)


def _inside(name: str) -> bool:
    """A member name that stays below the image's root: relative, and no `..` part."""
    return not name.startswith("/") and ".." not in name.split("/")


def _check_member(member: tarfile.TarInfo, name: str, layer: int, seen: set[str]) -> None:
    """A base layer is input like any other: a member that would land outside the root, a hard
    link to something no layer so far holds, or an account file too big to edit is refused."""
    where = f"layer {layer} of the runtime base"
    fix = "use another base: a container engine never writes such a layer"
    if not _inside(member.name):
        raise BuildFailure(f"{where} holds a member named {member.name[:200]!r}, outside the image's root", fix)
    if member.islnk():
        target = member.linkname.removeprefix("./").rstrip("/")
        if not _inside(member.linkname) or target not in seen:
            raise BuildFailure(f"/{name} in {where} is a hard link to {member.linkname[:200]!r}, which no layer "
                               "so far holds", fix)
    if member.isreg() and (name in ACCOUNT_FILES or name.startswith("etc/skel/")) and member.size > READ_CAP:
        raise BuildFailure(f"/{name} in {where} holds {member.size} bytes, over the {READ_CAP >> 20} MiB an "
                           "account or skeleton file may have to be edited", fix)


def transform_layers(layers: list, user: TrainingUser, epoch: int, outputs: list[Path]) -> list[LayerBlob]:
    """`layers`: the base's layer tars as readable streams, oldest first; one output per layer."""
    lines = account_lines(user, epoch // 86400)
    captured: dict[str, tuple[tarfile.TarInfo, bytes]] = {}
    skel: dict[str, bytes] = {}
    seen: set[str] = set()     # files of every layer so far: what a hard link may point to
    blobs = []
    for index, (stream, out) in enumerate(zip(layers, outputs, strict=True)):
        last = index == len(layers) - 1
        writer = LayerWriter(out, epoch)
        written: set[str] = set()
        try:
            with tarfile.open(fileobj=stream, mode="r|") as source:
                for member in source:
                    name = member.name.removeprefix("./").rstrip("/")
                    if _dropped(name):
                        continue
                    if member.islnk() and _dropped(member.linkname.removeprefix("./")):
                        raise BuildFailure(f"/{name} in the runtime base is a hard link into "
                                           f"/{member.linkname}, which the image drops", "use another base")
                    _check_member(member, name, index + 1, seen)
                    if not member.isdir():
                        seen.add(name)
                    member.uname = member.gname = ""
                    member.pax_headers = {k: v for k, v in member.pax_headers.items()
                                          if not k.startswith(XATTR_PREFIXES)}
                    if member.isreg():
                        member.mode &= ~0o6000
                        data = source.extractfile(member).read(READ_CAP) if name in ACCOUNT_FILES or \
                            name.startswith("etc/skel/") else None
                        if name.startswith("etc/skel/"):
                            skel[name.removeprefix("etc/skel/")] = data
                        if name in ACCOUNT_FILES:
                            captured[name] = (member, data)
                            if last:
                                edited = add_account(name, data.decode(), user, lines[name]).encode()
                                member.size = len(edited)
                                writer.add_member(member, io.BytesIO(edited))
                                written.add(name)
                            else:
                                writer.add_member(member, io.BytesIO(data))
                            continue
                        writer.add_member(member, io.BytesIO(data) if data is not None else source.extractfile(member))
                    else:
                        writer.add_member(member)
            if last:
                _add_user(writer, user, lines, captured, written, skel)
            blobs.append(writer.close())
        except BaseException:
            writer.abort()
            out.unlink(missing_ok=True)    # no half-written layer is left for anything to pick up
            raise
    return blobs


def _add_user(writer: LayerWriter, user: TrainingUser, lines: dict[str, str],
              captured: dict[str, tuple[tarfile.TarInfo, bytes]], written: set[str], skel: dict[str, bytes]) -> None:
    for name in ACCOUNT_FILES:
        if name in written:
            continue
        if name not in captured:
            raise BuildFailure(f"the runtime base has no /{name}, so the training user cannot be added",
                               "use a Debian-based runtime base")
        member, data = captured[name]
        edited = add_account(name, data.decode(), user, lines[name]).encode()
        member.size = len(edited)
        writer.add_member(member, io.BytesIO(edited))
    mine = Owner(user.uid, user.gid)
    writer.add(TreeEntry(user.home, "dir", DIR_MODE, mine))
    for rel in sorted(skel):
        if "/" not in rel:       # useradd copies the skeleton's files; it has no folders on Debian
            writer.add(TreeEntry(f"{user.home}/{rel}", "file", FILE_MODE, mine, data=skel[rel]))
    writer.add(TreeEntry("workspace", "dir", DIR_MODE, mine))


def base_keys(diff_ids: list[str], user: TrainingUser) -> list[str]:
    """The cache key of each edited base layer: the base's diffIDs up to it, and the user."""
    return [layer_key("base", {"diff_ids": diff_ids[:i + 1], "user": [user.name, user.uid, user.gid],
                               "dropped": list(DROPPED), "last": i == len(diff_ids) - 1})
            for i in range(len(diff_ids))]


def base_layers(engine, cache: LayerCache, scratch: Path, base_ref: str, user: TrainingUser, *,
                info: dict | None = None, load: Callable[[], str] | None = None) -> list[CachedLayer]:
    """The runtime base's layers, edited; cached by the base's diffIDs and the user. `info`: the
    base's inspect fields when it is not in the engine (a registry base), and `load` what puts it
    there, called only when a layer must be made here."""
    info = info or engine.image(base_ref)
    if info is None:
        raise BuildFailure(f"the runtime base {base_ref} is not in the engine", "build again: bases are made first")
    diff_ids = list((info.get("RootFS") or {}).get("Layers") or [])
    if not diff_ids:
        raise BuildFailure(f"the engine lists no layers for the runtime base {base_ref}", "check the dockerd log")
    epoch = base_epoch({"created": info.get("Created", "")})
    keys = base_keys(diff_ids, user)
    found = [cache.find(key, {"name": "base", "created_by": _history(base_ref, i, len(keys), user), "mtime": epoch})
             for i, key in enumerate(keys)]
    if all(found):
        return found
    saved = scratch / "base-image.tar"
    engine.save(load() if load is not None else base_ref, saved)
    with tarfile.open(saved) as image:
        manifest = json.load(image.extractfile("manifest.json"))[0]
        streams = [image.extractfile(path) for path in manifest["Layers"]]
        made: list[CachedLayer] = []
        staged = [scratch / f"base-{i}.tar.gz" for i in range(len(streams))]
        blobs = transform_layers(streams, user, epoch, staged)
    for i, (key, blob) in enumerate(zip(keys, blobs, strict=True)):
        made.append(cache.get_or_make(
            key, "base", _history(base_ref, i, len(blobs), user), epoch,
            lambda path, blob=blob: _moved(blob, path)))
    saved.unlink(missing_ok=True)
    return made


def _moved(blob: LayerBlob, path: Path) -> LayerBlob:
    blob.path.replace(path)
    return LayerBlob(blob.diff_id, blob.digest, blob.size, path)


def _history(base_ref: str, index: int, count: int, user: TrainingUser) -> str:
    text = f"ftimage base {base_ref} layer {index + 1}/{count}: setuid cleared, python-wheels dropped"
    return text + (f"; user {user.name} ({user.uid}:{user.gid}), /workspace" if index == count - 1 else "")
