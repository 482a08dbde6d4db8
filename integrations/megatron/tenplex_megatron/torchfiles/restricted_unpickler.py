"""A pickle interpreter that builds only what an exact allow-list permits.

Python's :mod:`pickle` resolves any global a stream names (protocol 4
``STACK_GLOBAL`` even follows dotted names such as ``"os.system"`` from any
importable module) and then calls it (``REDUCE``, ``NEWOBJ``) or hands it
state (``BUILD``, which also calls an instance's ``__setstate__``). An
allow-list checked in ``find_class`` alone cannot stop that: an allowed
class is still called with the stream's arguments, and ``BUILD`` can plant
an instance attribute that a second ``BUILD`` then calls.

:func:`unpickle` interprets the opcodes itself:

- a global is looked up as the exact pair ``(module, name)`` in a
  :class:`Profile`; nothing is imported or resolved by attribute path;
- a global is pushed as the :class:`Rule` itself (an inert token) or as a
  plain value (a ``torch.dtype``), never as the callable it names;
- ``REDUCE``, ``NEWOBJ`` and ``BUILD`` go only to the rule's own handler,
  which checks the argument types and values before building anything;
- ``BUILD`` applies to an object at most once, and only where the profile
  has a builder for its type; ``__setstate__`` is never looked up;
- every length in the stream is checked against the bytes that are left,
  so a lying length is refused before anything is allocated;
- the stream must end with ``STOP``, one object on the stack, no trailing bytes.

Only the opcodes the profile lists are accepted (the subset that
``pickle.dump`` protocol 4 and ``torch.save``'s protocol 2 write for the
records tenplex reads). Everything else raises
:class:`~tenplex.errors.UnsafePickleError` naming the file, the byte offset
and what was refused.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Callable

from tenplex.errors import UnsafePickleError
from tenplex.limits import MAX_PICKLE_OBJECTS, SAFE_REPR, short

__all__ = ["Refused", "Rule", "Profile", "unpickle", "MAX_PICKLE_BYTES"]

MAX_PICKLE_BYTES = 1 << 30
"""The largest pickle stream tenplex interprets (1 GiB); a larger one is refused."""


class Refused(Exception):
    """Raised by a handler: the stream asked for something the rule does not allow."""


@dataclass(frozen=True, eq=False)
class Rule:
    """One allowed global, named exactly, and what a stream may do with it.

    Attributes:
        module, name: the global, exactly as the stream must name it.
        value: what the GLOBAL opcode pushes; ``None`` pushes the rule itself
            (an inert token that only this rule's handlers accept).
        reduce: ``reduce(args: tuple) -> object`` for ``REDUCE``; None refuses it.
        new: ``new(args: tuple) -> object`` for ``NEWOBJ``; None refuses it.
        reason: why the global is allowed (shown in documentation and errors).
    """

    module: str
    name: str
    value: Any = None
    reduce: Callable[[tuple], Any] | None = None
    new: Callable[[tuple], Any] | None = None
    reason: str = ""

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"


SAFE_REPR.add(Rule)


@dataclass
class Profile:
    """What one kind of file may contain.

    Attributes:
        kind: a name for messages (``"DCP metadata"``, ``"torch file"``).
        rules: ``{(module, name): Rule}``.
        builders: ``{type: build(obj, state)}``; ``BUILD`` on any other type is refused.
        must_build: types whose objects must receive ``BUILD`` exactly once
            before ``STOP`` (records created empty by ``NEWOBJ``).
        opcodes: the opcode names accepted.
        persistent_load: ``load(pid) -> object`` for ``BINPERSID``; None refuses it.
        dict_types: the container types ``SETITEM(S)`` may fill.
    """

    kind: str
    rules: dict[tuple[str, str], Rule]
    builders: dict[type, Callable[[Any, Any], None]] = field(default_factory=dict)
    must_build: tuple[type, ...] = ()
    opcodes: frozenset[str] = frozenset()
    persistent_load: Callable[[Any], Any] | None = None
    dict_types: tuple[type, ...] = (dict,)


_OPS = {
    b"\x80": "PROTO", b"\x95": "FRAME", b".": "STOP", b"(": "MARK", b"\x94": "MEMOIZE",
    b"q": "BINPUT", b"r": "LONG_BINPUT", b"h": "BINGET", b"j": "LONG_BINGET",
    b")": "EMPTY_TUPLE", b"t": "TUPLE", b"\x85": "TUPLE1", b"\x86": "TUPLE2", b"\x87": "TUPLE3",
    b"]": "EMPTY_LIST", b"a": "APPEND", b"e": "APPENDS", b"}": "EMPTY_DICT", b"s": "SETITEM",
    b"u": "SETITEMS", b"N": "NONE", b"\x88": "NEWTRUE", b"\x89": "NEWFALSE", b"J": "BININT",
    b"K": "BININT1", b"M": "BININT2", b"\x8a": "LONG1", b"G": "BINFLOAT",
    b"\x8c": "SHORT_BINUNICODE", b"X": "BINUNICODE", b"C": "SHORT_BINBYTES", b"B": "BINBYTES",
    b"c": "GLOBAL", b"\x93": "STACK_GLOBAL", b"R": "REDUCE", b"\x81": "NEWOBJ", b"b": "BUILD",
    b"Q": "BINPERSID",
}

_NO_NEW_OBJECT = frozenset({"PROTO", "FRAME", "BINGET", "LONG_BINGET", "APPEND", "SETITEM", "BUILD"})
"""Opcodes that allocate nothing that lasts; every other one counts toward MAX_PICKLE_OBJECTS
(a memo entry or a MARK costs memory too)."""


def unpickle(data: bytes, profile: Profile, what: str) -> Any:
    """Interpret the pickle ``data`` under ``profile``.

    Args:
        data: the whole pickle stream (at most :data:`MAX_PICKLE_BYTES`).
        profile: the allow-list and the opcodes it accepts.
        what: the file (and record) the stream came from, for messages.

    Returns:
        The object the stream builds.

    Raises:
        UnsafePickleError: a global outside the allow-list, a call or state
            the rule refuses, an unknown opcode, a truncated stream or a length
            past its end, naming ``what``, the byte offset and the reason.
    """
    if len(data) > MAX_PICKLE_BYTES:
        raise UnsafePickleError(f"{what}: refusing unsafe unpickling (a {profile.kind} pickle of "
                                f"{len(data)} bytes; at most {MAX_PICKLE_BYTES} are read)")
    machine = _Machine(bytes(data), profile, what)
    try:
        return machine.run()
    except RecursionError:
        raise machine.fail("nested too deeply") from None
    except MemoryError:
        raise machine.fail("the objects it builds do not fit in memory") from None


class _Machine:
    def __init__(self, raw: bytes, profile: Profile, what: str):
        self.raw, self.data, self.profile, self.what = raw, memoryview(raw), profile, what
        self.pos = 0
        self.op_pos = 0
        self.stack: list = []
        self.marks: list[list] = []
        self.memo: dict[int, Any] = {}
        self.built: dict[int, Any] = {}     # id -> object: BUILD happened (kept alive: ids stay unique)
        self.unbuilt: dict[int, Any] = {}   # id -> object: must still receive BUILD
        self.objects = 0                    # objects built so far (at most MAX_PICKLE_OBJECTS)

    # ---------------------------------------------------------------- errors and reads
    def fail(self, reason: str) -> UnsafePickleError:
        return UnsafePickleError(f"{self.what}: refusing unsafe unpickling ({self.profile.kind}, "
                                 f"byte {self.op_pos}: {reason})")

    def take(self, n: int, op: str) -> memoryview:
        if n > len(self.data) - self.pos:
            raise self.fail(f"truncated: {op} needs {n} bytes, {len(self.data) - self.pos} left")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, op: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), op))[0]

    def pop(self, op: str, n: int = 1) -> list:
        if len(self.stack) < n:
            raise self.fail(f"{op} on a stack of {len(self.stack)} items (needs {n})")
        items = self.stack[len(self.stack) - n:]
        del self.stack[len(self.stack) - n:]
        return items

    def pop_mark(self, op: str) -> list:
        if not self.marks:
            raise self.fail(f"{op} without a MARK")
        items, self.stack = self.stack, self.marks.pop()
        return items

    def text(self, n: int, op: str) -> str:
        try:
            return str(self.take(n, op), "utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise self.fail(f"{op} is not UTF-8") from None

    # ---------------------------------------------------------------- the loop
    def run(self) -> Any:
        while True:
            self.op_pos = self.pos
            name = _OPS.get(bytes(self.take(1, "an opcode")))
            if name is None or name not in self.profile.opcodes:
                code = self.data[self.op_pos]
                raise self.fail(f"opcode {name or hex(code)} is not accepted in a {self.profile.kind}")
            if name == "STOP":
                return self.stop()
            if name not in _NO_NEW_OBJECT:
                self.objects += 1
                if self.objects > MAX_PICKLE_OBJECTS:
                    raise self.fail(f"more than {MAX_PICKLE_OBJECTS} objects (the limit "
                                    "TENPLEX_MAX_PICKLE_OBJECTS)")
            getattr(self, "op_" + name)(name)

    def stop(self) -> Any:
        if self.marks or len(self.stack) != 1:
            raise self.fail(f"STOP with {len(self.stack)} items on the stack and "
                            f"{len(self.marks)} open MARKs (expected one object)")
        if self.pos != len(self.data):
            raise self.fail(f"{len(self.data) - self.pos} bytes after STOP")
        if self.unbuilt:
            obj = next(iter(self.unbuilt.values()))
            raise self.fail(f"a {type(obj).__name__} was created but never given its state (BUILD)")
        return self.stack[0]

    def op_PROTO(self, op):
        version = self.take(1, op)[0]
        if self.op_pos != 0 or not 2 <= version <= 5:
            raise self.fail(f"PROTO {version} at byte {self.op_pos} (expected protocol 2-5 at byte 0)")

    def op_FRAME(self, op):
        size = self.unpack("<Q", op)
        if size > len(self.data) - self.pos:
            raise self.fail(f"truncated: FRAME of {size} bytes, {len(self.data) - self.pos} left")

    def op_MARK(self, op):
        self.marks.append(self.stack)
        self.stack = []

    def memo_put(self, index: int, op: str):
        if not self.stack:
            raise self.fail(f"{op} on an empty stack")
        self.memo[index] = self.stack[-1]

    def op_MEMOIZE(self, op):
        self.memo_put(len(self.memo), op)

    def op_BINPUT(self, op):
        self.memo_put(self.take(1, op)[0], op)

    def op_LONG_BINPUT(self, op):
        self.memo_put(self.unpack("<I", op), op)

    def memo_get(self, index: int):
        if index not in self.memo:
            raise self.fail(f"memo entry {index} was never stored")
        self.stack.append(self.memo[index])

    def op_BINGET(self, op):
        self.memo_get(self.take(1, op)[0])

    def op_LONG_BINGET(self, op):
        self.memo_get(self.unpack("<I", op))

    # ---------------------------------------------------------------- containers
    def op_EMPTY_TUPLE(self, op):
        self.stack.append(())

    def op_TUPLE(self, op):
        items = tuple(self.pop_mark(op))  # first: popping the mark replaces self.stack
        self.stack.append(items)

    def op_TUPLE1(self, op):
        self.stack.append(tuple(self.pop(op, 1)))

    def op_TUPLE2(self, op):
        self.stack.append(tuple(self.pop(op, 2)))

    def op_TUPLE3(self, op):
        self.stack.append(tuple(self.pop(op, 3)))

    def op_EMPTY_LIST(self, op):
        self.stack.append([])

    def op_EMPTY_DICT(self, op):
        self.stack.append({})

    def target(self, op: str, types: tuple) -> Any:
        if not self.stack or type(self.stack[-1]) not in types:
            found = type(self.stack[-1]).__name__ if self.stack else "an empty stack"
            raise self.fail(f"{op} into {found} (expected {' or '.join(t.__name__ for t in types)})")
        return self.stack[-1]

    def op_APPEND(self, op):
        item = self.pop(op)[0]
        self.target(op, (list,)).append(item)

    def op_APPENDS(self, op):
        items = self.pop_mark(op)
        self.target(op, (list,)).extend(items)

    def set_items(self, op: str, items: list):
        if len(items) % 2:
            raise self.fail(f"{op} with an odd number ({len(items)}) of keys and values")
        target = self.target(op, self.profile.dict_types)
        for i in range(0, len(items), 2):
            try:
                target[items[i]] = items[i + 1]
            except (TypeError, AttributeError) as exc:
                raise self.fail(f"{op} with an unusable key of type {type(items[i]).__name__} "
                                f"({exc})") from None

    def op_SETITEM(self, op):
        self.set_items(op, self.pop(op, 2))

    def op_SETITEMS(self, op):
        self.set_items(op, self.pop_mark(op))

    # ---------------------------------------------------------------- scalars
    def op_NONE(self, op):
        self.stack.append(None)

    def op_NEWTRUE(self, op):
        self.stack.append(True)

    def op_NEWFALSE(self, op):
        self.stack.append(False)

    def op_BININT(self, op):
        self.stack.append(self.unpack("<i", op))

    def op_BININT1(self, op):
        self.stack.append(self.take(1, op)[0])

    def op_BININT2(self, op):
        self.stack.append(self.unpack("<H", op))

    def op_LONG1(self, op):
        n = self.take(1, op)[0]
        self.stack.append(int.from_bytes(self.take(n, op), "little", signed=True))

    def op_BINFLOAT(self, op):
        self.stack.append(self.unpack(">d", op))

    def op_SHORT_BINUNICODE(self, op):
        self.stack.append(self.text(self.take(1, op)[0], op))

    def op_BINUNICODE(self, op):
        self.stack.append(self.text(self.unpack("<I", op), op))

    def op_SHORT_BINBYTES(self, op):
        self.stack.append(bytes(self.take(self.take(1, op)[0], op)))

    def op_BINBYTES(self, op):
        self.stack.append(bytes(self.take(self.unpack("<I", op), op)))

    # ---------------------------------------------------------------- globals and calls
    def lookup(self, module: Any, name: Any) -> Any:
        if not isinstance(module, str) or not isinstance(name, str):
            raise self.fail("a global named by non-strings")
        rule = self.profile.rules.get((module, name))
        if rule is None:
            why = (" (dotted names are not resolved)" if "." in name else "")
            raise self.fail(f"global {module[:120]}.{name[:120]} is not in the {self.profile.kind} "
                            f"allow-list{why}")
        return rule if rule.value is None else rule.value

    def op_GLOBAL(self, op):
        parts = []
        for _ in range(2):
            end = self.raw.find(b"\n", self.pos)
            if end < 0:
                raise self.fail("truncated: GLOBAL without a newline")
            parts.append(self.text(end - self.pos, op))
            self.pos += 1
        self.stack.append(self.lookup(*parts))

    def op_STACK_GLOBAL(self, op):
        module, name = self.pop(op, 2)
        self.stack.append(self.lookup(module, name))

    def call(self, op: str, rule: Any, args: Any, kind: str) -> None:
        handler = getattr(rule, kind, None) if isinstance(rule, Rule) else None
        if handler is None:
            raise self.fail(f"{op} on {short(rule, 60)} is not allowed")
        if type(args) is not tuple:
            raise self.fail(f"{op} on {rule} with arguments of type {type(args).__name__}")
        try:
            obj = handler(args)
        except Refused as exc:
            raise self.fail(f"{op} on {rule}: {exc}") from None
        if isinstance(obj, self.profile.must_build):
            self.unbuilt[id(obj)] = obj
        self.stack.append(obj)

    def op_REDUCE(self, op):
        func, args = self.pop(op, 2)
        self.call(op, func, args, "reduce")

    def op_NEWOBJ(self, op):
        cls, args = self.pop(op, 2)
        self.call(op, cls, args, "new")

    def op_BUILD(self, op):
        state = self.pop(op)[0]
        if not self.stack:
            raise self.fail("BUILD on an empty stack")
        inst = self.stack[-1]
        builder = self.profile.builders.get(type(inst))
        if builder is None:
            raise self.fail(f"BUILD on {type(inst).__name__} is not allowed")
        if id(inst) in self.built:
            raise self.fail(f"a second BUILD on the same {type(inst).__name__}")
        try:
            builder(inst, state)
        except Refused as exc:
            raise self.fail(f"BUILD on {type(inst).__name__}: {exc}") from None
        self.built[id(inst)] = inst
        self.unbuilt.pop(id(inst), None)

    def op_BINPERSID(self, op):
        pid = self.pop(op)[0]
        if self.profile.persistent_load is None:
            raise self.fail("persistent ids are not allowed")
        try:
            self.stack.append(self.profile.persistent_load(pid))
        except Refused as exc:
            raise self.fail(f"persistent id {short(pid, 80)}: {exc}") from None
