//! The object graph a pickle builds: inline scalars and an arena of objects referred to by
//! index, so that what the memo shares stays shared.

/// A value on the machine's stack or in a container: small scalars inline, everything else an
/// index into [`Graph::objs`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Val {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Obj(u32),
}

/// An object of the arena.
#[derive(Debug, Clone, PartialEq)]
pub enum Obj {
    Str(Box<str>),
    Bytes(Box<[u8]>),
    /// An integer beyond `i64`: little-endian two's complement, as `LONG1` carries it.
    BigInt(Box<[u8]>),
    List(Vec<Val>),
    Tuple(Box<[Val]>),
    Dict(Vec<(Val, Val)>),
    Set(Vec<Val>),
    /// A container whose items were dropped (see [`Unpickler::prune_keys`](super::Unpickler::prune_keys)).
    Pruned(Kind),
    /// `module.name`, never imported.
    Global(Box<str>),
    /// What calling or instantiating a global produced; its arguments and state are dropped.
    Instance(Box<str>),
}

/// The kind of a container, for [`Obj::Pruned`] and messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    List,
    Dict,
    Set,
}

/// The result of unpickling: the arena and the top value.
#[derive(Debug, Default)]
pub struct Graph {
    pub objs: Vec<Obj>,
    pub root: Option<Val>,
}

impl Graph {
    /// The object a value refers to (`None` for inline scalars).
    pub fn obj(&self, v: Val) -> Option<&Obj> {
        match v {
            Val::Obj(i) => self.objs.get(i as usize),
            _ => None,
        }
    }

    /// The string a value is, if it is one.
    pub fn str(&self, v: Val) -> Option<&str> {
        match self.obj(v) {
            Some(Obj::Str(s)) => Some(s),
            _ => None,
        }
    }

    /// The items of a list or tuple.
    pub fn seq(&self, v: Val) -> Option<&[Val]> {
        match self.obj(v) {
            Some(Obj::List(l)) => Some(l),
            Some(Obj::Tuple(t)) => Some(t),
            _ => None,
        }
    }

    /// The value of string key `key` in dict `v` (`None` if `v` is no dict or has no such key).
    pub fn get(&self, v: Val, key: &str) -> Option<Val> {
        match self.obj(v) {
            Some(Obj::Dict(pairs)) => pairs
                .iter()
                .rev()
                .find(|(k, _)| self.str(*k) == Some(key))
                .map(|&(_, v)| v),
            _ => None,
        }
    }

    /// The integer a value is, if it fits in `u64`.
    pub fn u64(&self, v: Val) -> Option<u64> {
        match v {
            Val::Int(i) => u64::try_from(i).ok(),
            Val::Bool(b) => Some(u64::from(b)),
            Val::Obj(_) => match self.obj(v) {
                Some(Obj::BigInt(bytes)) => big_to_u64(bytes),
                _ => None,
            },
            _ => None,
        }
    }

    /// "a dict", "an int", ...: what a value is, for messages.
    pub fn type_name(&self, v: Val) -> &'static str {
        match v {
            Val::None => "None",
            Val::Bool(_) => "a bool",
            Val::Int(_) => "an int",
            Val::Float(_) => "a float",
            Val::Obj(_) => match self.obj(v) {
                Some(Obj::Str(_)) => "a string",
                Some(Obj::Bytes(_)) => "bytes",
                Some(Obj::BigInt(_)) => "an int",
                Some(Obj::List(_) | Obj::Pruned(Kind::List)) => "a list",
                Some(Obj::Tuple(_)) => "a tuple",
                Some(Obj::Dict(_) | Obj::Pruned(Kind::Dict)) => "a dict",
                Some(Obj::Set(_) | Obj::Pruned(Kind::Set)) => "a set",
                Some(Obj::Global(_)) => "a class",
                Some(Obj::Instance(_)) | None => "an object",
            },
        }
    }

    /// A short rendering of a scalar for messages (`12`, `"12"`), else its type name.
    pub fn repr(&self, v: Val) -> String {
        match v {
            Val::Int(i) => i.to_string(),
            Val::Float(f) => f.to_string(),
            _ => match self.obj(v) {
                Some(Obj::Str(s)) => format!("{s:?}"),
                Some(Obj::BigInt(b)) => big_repr(b),
                _ => self.type_name(v).to_string(),
            },
        }
    }
}

fn big_to_u64(bytes: &[u8]) -> Option<u64> {
    let negative = bytes.last().is_some_and(|b| b & 0x80 != 0);
    if negative {
        return None;
    }
    let significant = bytes.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    if significant > 8 {
        return None;
    }
    let mut buf = [0u8; 8];
    buf[..significant].copy_from_slice(&bytes[..significant]);
    Some(u64::from_le_bytes(buf))
}

fn big_repr(bytes: &[u8]) -> String {
    let hex: String = bytes.iter().rev().map(|b| format!("{b:02x}")).collect();
    format!("0x{hex} (two's complement)")
}
