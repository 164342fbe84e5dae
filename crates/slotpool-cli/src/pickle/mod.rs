//! A streaming pickle reader that builds a compact object graph and can drop subtrees.
//!
//! [`Unpickler`] runs the pickle virtual machine (protocols 0 to 5) over any [`BufRead`], one
//! opcode at a time, without reading the whole stream first. Objects live in one arena and are
//! referred to by index, so the memo shares them as Python does: a `BINGET` pushes a reference
//! rather than a copy. Containers that are the value of a key named in
//! [`Unpickler::prune_keys`] (and every container created inside them) keep no items: PyTorch's
//! snapshots carry some 25 stack frames per trace entry, and a reader that only needs the entries'
//! scalars then holds a few bytes per frame list instead of the frames.
//!
//! Classes are never imported: a `GLOBAL` becomes [`Obj::Global`] and whatever a class builds
//! (`REDUCE`, `NEWOBJ`, `INST`, `OBJ`, `BUILD`) becomes an opaque [`Obj::Instance`]. Persistent
//! ids, extension codes and out-of-band buffers are refused. Every failure is a [`PickleError`]
//! with the byte offset of the opcode; nothing panics on bad input.

use std::io::{self, BufRead};

use thiserror::Error;

mod graph;

pub use graph::{Graph, Kind, Obj, Val};

/// Why a pickle could not be read.
#[derive(Debug, Error)]
pub enum PickleError {
    /// The underlying reader failed (for a gzip stream: corrupt or truncated data).
    #[error("{0}")]
    Io(#[source] io::Error),
    #[error("the pickle ends in the middle (byte {0})")]
    Truncated(u64),
    #[error("byte {at}: {message}")]
    Bad { at: u64, message: String },
}

type Result<T> = std::result::Result<T, PickleError>;

/// The pickle virtual machine over a buffered reader. See the module docs.
pub struct Unpickler<R> {
    input: R,
    /// Bytes consumed so far.
    pos: u64,
    /// Where the current opcode began, for messages.
    op_at: u64,
    objs: Vec<Obj>,
    stack: Vec<Val>,
    marks: Vec<usize>,
    memo: Vec<Option<Val>>,
    prune: Vec<String>,
    scratch: Vec<u8>,
}

impl<R> std::fmt::Debug for Unpickler<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Unpickler")
            .field("pos", &self.pos)
            .field("objects", &self.objs.len())
            .field("stack", &self.stack.len())
            .field("memo", &self.memo.len())
            .field("prune", &self.prune)
            .finish_non_exhaustive()
    }
}

/// The reader's buffer, refilled if empty; the end of the input is [`PickleError::Truncated`].
fn fill<R: BufRead>(input: &mut R, pos: u64) -> Result<&[u8]> {
    match input.fill_buf() {
        Ok([]) => Err(PickleError::Truncated(pos)),
        Ok(b) => Ok(b),
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(&[]),
        Err(e) => Err(PickleError::Io(e)),
    }
}

/// How far past the end of the memo a `PUT` may write (pickles number their memo densely).
const MEMO_GAP: usize = 1 << 16;

impl<R: BufRead> Unpickler<R> {
    pub fn new(input: R) -> Self {
        Unpickler {
            input,
            pos: 0,
            op_at: 0,
            objs: Vec::new(),
            stack: Vec::new(),
            marks: Vec::new(),
            memo: Vec::new(),
            prune: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// Containers that are the value of a string key in `keys` keep no items, nor do the
    /// containers created while one of them is being filled.
    pub fn prune_keys(mut self, keys: &[&str]) -> Self {
        self.prune = keys.iter().map(|k| k.to_string()).collect();
        self
    }

    /// Runs the machine to the `STOP` opcode and returns the graph. The reader is left just after
    /// the pickle.
    pub fn load(mut self) -> Result<Graph> {
        loop {
            self.op_at = self.pos;
            let op = self.byte()?;
            if op == b'.' {
                let root = self.pop()?;
                return Ok(Graph {
                    objs: self.objs,
                    root: Some(root),
                });
            }
            self.step(op)?;
        }
    }

    // -------------------------------------------------------------------------------------
    // Input

    fn fill(&mut self) -> Result<&[u8]> {
        fill(&mut self.input, self.pos)
    }

    fn byte(&mut self) -> Result<u8> {
        loop {
            if let Some(&b) = self.fill()?.first() {
                self.input.consume(1);
                self.pos += 1;
                return Ok(b);
            }
        }
    }

    /// The next `n` bytes, in `self.scratch`.
    fn bytes(&mut self, n: usize) -> Result<&[u8]> {
        self.scratch.clear();
        while self.scratch.len() < n {
            let buf = fill(&mut self.input, self.pos)?;
            let take = buf.len().min(n - self.scratch.len());
            self.scratch.extend_from_slice(&buf[..take]);
            self.input.consume(take);
            self.pos += take as u64;
        }
        Ok(&self.scratch)
    }

    fn le<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.bytes(N)?);
        Ok(out)
    }

    fn len_u32(&mut self) -> Result<usize> {
        Ok(u32::from_le_bytes(self.le()?) as usize)
    }

    fn len_u64(&mut self) -> Result<usize> {
        let n = u64::from_le_bytes(self.le()?);
        usize::try_from(n).map_err(|_| self.bad(format!("length {n} is too large")))
    }

    /// A text line without its `\n` (protocol 0 arguments).
    fn line(&mut self) -> Result<String> {
        self.scratch.clear();
        loop {
            let buf = fill(&mut self.input, self.pos)?;
            if let Some(i) = buf.iter().position(|&b| b == b'\n') {
                self.scratch.extend_from_slice(&buf[..i]);
                self.input.consume(i + 1);
                self.pos += i as u64 + 1;
                break;
            }
            let n = buf.len();
            self.scratch.extend_from_slice(buf);
            self.input.consume(n);
            self.pos += n as u64;
        }
        let line = self.scratch.strip_suffix(b"\r").unwrap_or(&self.scratch);
        Ok(String::from_utf8_lossy(line).into_owned())
    }

    // -------------------------------------------------------------------------------------
    // Stack, memo, arena

    fn bad(&self, message: impl Into<String>) -> PickleError {
        PickleError::Bad {
            at: self.op_at,
            message: message.into(),
        }
    }

    fn pop(&mut self) -> Result<Val> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.bad("stack underflow"));
        }
        self.stack.pop().ok_or_else(|| self.bad("stack underflow"))
    }

    fn top(&self) -> Result<Val> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.bad("stack underflow"));
        }
        self.stack
            .last()
            .copied()
            .ok_or_else(|| self.bad("stack underflow"))
    }

    /// The items above the innermost mark, and the mark removed.
    fn pop_mark(&mut self) -> Result<Vec<Val>> {
        let m = self.marks.pop().ok_or_else(|| self.bad("no mark"))?;
        Ok(self.stack.split_off(m))
    }

    fn alloc(&mut self, obj: Obj) -> Result<Val> {
        let id = u32::try_from(self.objs.len()).map_err(|_| self.bad("too many objects"))?;
        self.objs.push(obj);
        Ok(Val::Obj(id))
    }

    fn push_obj(&mut self, obj: Obj) -> Result<()> {
        let v = self.alloc(obj)?;
        self.stack.push(v);
        Ok(())
    }

    fn push_str(&mut self, n: usize) -> Result<()> {
        let bytes = self.bytes(n)?;
        let s: Box<str> = match std::str::from_utf8(bytes) {
            Ok(s) => s.into(),
            // Lone surrogates (Python's `surrogatepass`): keep what can be kept.
            Err(_) => String::from_utf8_lossy(bytes).into(),
        };
        self.push_obj(Obj::Str(s))
    }

    fn push_bytes(&mut self, n: usize) -> Result<()> {
        let b: Box<[u8]> = self.bytes(n)?.into();
        self.push_obj(Obj::Bytes(b))
    }

    fn put(&mut self, idx: usize) -> Result<()> {
        let v = self.top()?;
        if idx >= self.memo.len() {
            if idx > self.memo.len() + MEMO_GAP {
                return Err(self.bad(format!("memo index {idx} out of range")));
            }
            self.memo.resize(idx + 1, None);
        }
        self.memo[idx] = Some(v);
        Ok(())
    }

    fn get(&mut self, idx: usize) -> Result<()> {
        let v = self
            .memo
            .get(idx)
            .copied()
            .flatten()
            .ok_or_else(|| self.bad(format!("memo index {idx} was never stored")))?;
        self.stack.push(v);
        Ok(())
    }

    fn is_pruned(&self, v: Val) -> bool {
        matches!(self.obj_ref(v), Some(Obj::Pruned(_)))
    }

    fn obj_ref(&self, v: Val) -> Option<&Obj> {
        match v {
            Val::Obj(i) => self.objs.get(i as usize),
            _ => None,
        }
    }

    /// Whether a container about to be pushed is to keep no items: it is the value of a pruned
    /// key, or it is created while a pruned container is being filled.
    fn prune_next(&self) -> bool {
        if self.prune.is_empty() {
            return false;
        }
        if let Some(&below) = self.stack.last() {
            if self.is_pruned(below) {
                return true;
            }
            if let Some(Obj::Str(s)) = self.obj_ref(below)
                && self.prune.iter().any(|k| **k == **s)
            {
                return true;
            }
        }
        self.marks
            .last()
            .and_then(|&m| m.checked_sub(1))
            .and_then(|i| self.stack.get(i))
            .is_some_and(|&c| self.is_pruned(c))
    }

    fn new_container(&mut self, kind: Kind) -> Result<()> {
        let obj = if self.prune_next() {
            Obj::Pruned(kind)
        } else {
            match kind {
                Kind::List => Obj::List(Vec::new()),
                Kind::Dict => Obj::Dict(Vec::new()),
                Kind::Set => Obj::Set(Vec::new()),
            }
        };
        self.push_obj(obj)
    }

    /// Adds `items` to the container `target` (a list, a set, or a dict given pairs).
    fn extend(&mut self, target: Val, items: Vec<Val>) -> Result<()> {
        let name = self.objs_type(target);
        let at = self.op_at;
        let Val::Obj(id) = target else {
            return Err(self.bad(format!("cannot add items to {name}")));
        };
        match self.objs.get_mut(id as usize) {
            Some(Obj::Pruned(_)) => Ok(()),
            Some(Obj::List(l)) => {
                l.extend(items);
                Ok(())
            }
            Some(Obj::Set(s)) => {
                s.extend(items);
                Ok(())
            }
            Some(Obj::Dict(d)) => {
                if !items.len().is_multiple_of(2) {
                    return Err(PickleError::Bad {
                        at,
                        message: "odd number of items for a dict".into(),
                    });
                }
                d.extend(items.chunks_exact(2).map(|kv| (kv[0], kv[1])));
                Ok(())
            }
            // Appending to an object is `obj.append(x)` / `obj[k] = v`: dropped with the object.
            Some(Obj::Instance(_)) => Ok(()),
            _ => Err(PickleError::Bad {
                at,
                message: format!("cannot add items to {name}"),
            }),
        }
    }

    fn objs_type(&self, v: Val) -> &'static str {
        match v {
            Val::Obj(_) => match self.obj_ref(v) {
                Some(Obj::Str(_)) => "a string",
                Some(Obj::Tuple(_)) => "a tuple",
                Some(Obj::Global(_)) => "a class",
                _ => "an object",
            },
            Val::None => "None",
            _ => "a number",
        }
    }

    fn global_name(&self, v: Val) -> Box<str> {
        match self.obj_ref(v) {
            Some(Obj::Global(n)) => n.clone(),
            Some(Obj::Instance(n)) => n.clone(),
            _ => "?".into(),
        }
    }

    // -------------------------------------------------------------------------------------
    // Opcodes

    fn step(&mut self, op: u8) -> Result<()> {
        match op {
            0x80 => {
                let proto = self.byte()?;
                if proto > 5 {
                    return Err(self.bad(format!("unsupported pickle protocol {proto}")));
                }
            }
            0x95 => {
                // FRAME: a length hint only.
                self.le::<8>()?;
            }
            b'(' => self.marks.push(self.stack.len()),
            b'0' => {
                self.pop()?;
            }
            b'1' => {
                self.pop_mark()?;
            }
            b'2' => {
                let v = self.top()?;
                self.stack.push(v);
            }
            b'N' => self.stack.push(Val::None),
            0x88 => self.stack.push(Val::Bool(true)),
            0x89 => self.stack.push(Val::Bool(false)),
            b'J' => {
                let v = i32::from_le_bytes(self.le()?);
                self.stack.push(Val::Int(i64::from(v)));
            }
            b'K' => {
                let v = self.byte()?;
                self.stack.push(Val::Int(i64::from(v)));
            }
            b'M' => {
                let v = u16::from_le_bytes(self.le()?);
                self.stack.push(Val::Int(i64::from(v)));
            }
            0x8a => {
                let n = usize::from(self.byte()?);
                self.push_long(n)?;
            }
            0x8b => {
                let n = self.len_u32()?;
                self.push_long(n)?;
            }
            b'I' => {
                let line = self.line()?;
                let v = match line.trim() {
                    "00" => Val::Bool(false),
                    "01" => Val::Bool(true),
                    t => Val::Int(t.parse().map_err(|_| self.bad(format!("bad INT {t:?}")))?),
                };
                self.stack.push(v);
            }
            b'L' => {
                let line = self.line()?;
                let t = line.trim().trim_end_matches('L');
                let v = t.parse().map_err(|_| self.bad(format!("bad LONG {t:?}")))?;
                self.stack.push(Val::Int(v));
            }
            b'F' => {
                let line = self.line()?;
                let t = line.trim();
                let v = t
                    .parse()
                    .map_err(|_| self.bad(format!("bad FLOAT {t:?}")))?;
                self.stack.push(Val::Float(v));
            }
            b'G' => {
                let v = f64::from_be_bytes(self.le()?);
                self.stack.push(Val::Float(v));
            }
            0x8c => {
                let n = usize::from(self.byte()?);
                self.push_str(n)?;
            }
            b'X' => {
                let n = self.len_u32()?;
                self.push_str(n)?;
            }
            0x8d => {
                let n = self.len_u64()?;
                self.push_str(n)?;
            }
            b'V' => {
                let line = self.line()?;
                self.push_obj(Obj::Str(line.into()))?;
            }
            // Python 2 strings (STRING, BINSTRING, SHORT_BINSTRING): bytes, decoded as text.
            b'S' => {
                let line = self.line()?;
                let t = line.trim();
                let inner = t
                    .strip_prefix(['\'', '"'])
                    .and_then(|x| x.strip_suffix(['\'', '"']))
                    .unwrap_or(t);
                self.push_obj(Obj::Str(inner.into()))?;
            }
            b'T' => {
                let n = self.len_u32()?;
                self.push_str(n)?;
            }
            b'U' => {
                let n = usize::from(self.byte()?);
                self.push_str(n)?;
            }
            b'C' => {
                let n = usize::from(self.byte()?);
                self.push_bytes(n)?;
            }
            b'B' => {
                let n = self.len_u32()?;
                self.push_bytes(n)?;
            }
            0x8e | 0x96 => {
                let n = self.len_u64()?;
                self.push_bytes(n)?;
            }
            b']' => self.new_container(Kind::List)?,
            b'}' => self.new_container(Kind::Dict)?,
            0x8f => self.new_container(Kind::Set)?,
            b')' => self.push_obj(Obj::Tuple(Box::new([])))?,
            b'l' => {
                let pruned = self.prune_after_mark();
                let items = self.pop_mark()?;
                self.push_obj(if pruned {
                    Obj::Pruned(Kind::List)
                } else {
                    Obj::List(items)
                })?;
            }
            b'd' => {
                let pruned = self.prune_after_mark();
                let items = self.pop_mark()?;
                if !items.len().is_multiple_of(2) {
                    return Err(self.bad("odd number of items for a dict"));
                }
                self.push_obj(if pruned {
                    Obj::Pruned(Kind::Dict)
                } else {
                    Obj::Dict(items.chunks_exact(2).map(|kv| (kv[0], kv[1])).collect())
                })?;
            }
            0x91 => {
                let items = self.pop_mark()?;
                self.push_obj(Obj::Set(items))?;
            }
            b't' => {
                let items = self.pop_mark()?;
                self.push_obj(Obj::Tuple(items.into()))?;
            }
            0x85..=0x87 => {
                let n = usize::from(op - 0x84);
                let floor = self.marks.last().copied().unwrap_or(0);
                if self.stack.len() < floor + n {
                    return Err(self.bad("stack underflow"));
                }
                let items = self.stack.split_off(self.stack.len() - n);
                self.push_obj(Obj::Tuple(items.into()))?;
            }
            b'a' => {
                let item = self.pop()?;
                let list = self.top()?;
                self.extend(list, vec![item])?;
            }
            b'e' | 0x90 => {
                let items = self.pop_mark()?;
                let target = self.top()?;
                self.extend(target, items)?;
            }
            b's' => {
                let v = self.pop()?;
                let k = self.pop()?;
                let dict = self.top()?;
                self.extend(dict, vec![k, v])?;
            }
            b'u' => {
                let items = self.pop_mark()?;
                let dict = self.top()?;
                self.extend(dict, items)?;
            }
            b'p' => {
                let line = self.line()?;
                let idx = line
                    .trim()
                    .parse()
                    .map_err(|_| self.bad(format!("bad PUT index {line:?}")))?;
                self.put(idx)?;
            }
            b'q' => {
                let idx = usize::from(self.byte()?);
                self.put(idx)?;
            }
            b'r' => {
                let idx = self.len_u32()?;
                self.put(idx)?;
            }
            0x94 => {
                let idx = self.memo.len();
                self.put(idx)?;
            }
            b'g' => {
                let line = self.line()?;
                let idx = line
                    .trim()
                    .parse()
                    .map_err(|_| self.bad(format!("bad GET index {line:?}")))?;
                self.get(idx)?;
            }
            b'h' => {
                let idx = usize::from(self.byte()?);
                self.get(idx)?;
            }
            b'j' => {
                let idx = self.len_u32()?;
                self.get(idx)?;
            }
            b'c' => {
                let module = self.line()?;
                let name = self.line()?;
                self.push_obj(Obj::Global(format!("{module}.{name}").into()))?;
            }
            0x93 => {
                let name = self.pop()?;
                let module = self.pop()?;
                let (Some(Obj::Str(m)), Some(Obj::Str(n))) =
                    (self.obj_ref(module), self.obj_ref(name))
                else {
                    return Err(self.bad("STACK_GLOBAL needs two strings"));
                };
                let full = format!("{m}.{n}");
                self.push_obj(Obj::Global(full.into()))?;
            }
            // REDUCE and NEWOBJ: callable/class and its arguments.
            b'R' | 0x81 => {
                self.pop()?;
                let callable = self.pop()?;
                let name = self.global_name(callable);
                self.push_obj(Obj::Instance(name))?;
            }
            0x92 => {
                self.pop()?;
                self.pop()?;
                let class = self.pop()?;
                let name = self.global_name(class);
                self.push_obj(Obj::Instance(name))?;
            }
            b'b' => {
                // BUILD: the state is dropped with the object it would set.
                self.pop()?;
                self.top()?;
            }
            b'i' => {
                let module = self.line()?;
                let name = self.line()?;
                self.pop_mark()?;
                self.push_obj(Obj::Instance(format!("{module}.{name}").into()))?;
            }
            b'o' => {
                let items = self.pop_mark()?;
                let class = items
                    .first()
                    .copied()
                    .ok_or_else(|| self.bad("OBJ without a class"))?;
                let name = self.global_name(class);
                self.push_obj(Obj::Instance(name))?;
            }
            0x97 => {
                // READONLY_BUFFER: a no-op on what NEXT_BUFFER would have pushed.
                self.top()?;
            }
            b'P' | b'Q' => return Err(self.bad("persistent ids are not supported")),
            0x82..=0x84 => return Err(self.bad("extension codes are not supported")),
            0x98 => return Err(self.bad("out-of-band buffers are not supported")),
            other => return Err(self.bad(format!("unknown opcode 0x{other:02x}"))),
        }
        Ok(())
    }

    /// For `LIST`/`DICT` (built from the items above a mark): whether the container will be
    /// pruned, judged from what lies below the mark.
    fn prune_after_mark(&self) -> bool {
        if self.prune.is_empty() {
            return false;
        }
        let Some(&m) = self.marks.last() else {
            return false;
        };
        let below = m.checked_sub(1).and_then(|i| self.stack.get(i)).copied();
        below.is_some_and(|b| {
            self.is_pruned(b)
                || matches!(self.obj_ref(b), Some(Obj::Str(s)) if self.prune.iter().any(|k| **k == **s))
        })
    }

    fn push_long(&mut self, n: usize) -> Result<()> {
        let bytes = self.bytes(n)?;
        if n <= 8 {
            let mut buf = if bytes.last().is_some_and(|b| b & 0x80 != 0) {
                [0xffu8; 8]
            } else {
                [0u8; 8]
            };
            buf[..n].copy_from_slice(bytes);
            self.stack.push(Val::Int(i64::from_le_bytes(buf)));
            Ok(())
        } else {
            let b: Box<[u8]> = bytes.into();
            self.push_obj(Obj::BigInt(b))
        }
    }
}

#[cfg(test)]
mod tests;
