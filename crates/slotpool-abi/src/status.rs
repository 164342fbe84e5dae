//! `sp_status`: the code every C ABI call returns, with its name and what it means.

use std::ffi::{CStr, c_int};

/// Defines [`sp_status`] and [`sp_status::ALL`] from one list, so that a code, its name and its
/// message are written once.
macro_rules! status_codes {
    ($( $name:ident = $value:literal : $message:literal, )*) => {
        /// Status returned by every `sp_*` call (`sp_status` in `slotpool.h`).
        #[repr(C)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum sp_status {
            $( #[doc = $message] $name = $value, )*
        }

        impl sp_status {
            /// Every status code, in the order of the codes.
            pub const ALL: &'static [sp_status] = &[ $( sp_status::$name, )* ];

            /// The code's name (`"SP_OK"`, `"SP_ERR_OUT_OF_MEMORY"`, ...), NUL-terminated.
            pub const fn name(self) -> &'static CStr {
                match self {
                    // `concat!` adds the terminating NUL to the variant's name.
                    $( sp_status::$name => match CStr::from_bytes_with_nul(
                        concat!(stringify!($name), "\0").as_bytes(),
                    ) {
                        Ok(name) => name,
                        Err(_) => panic!("a status name has a NUL"),
                    }, )*
                }
            }

            /// What the code means, in one sentence.
            pub const fn message(self) -> &'static str {
                match self {
                    $( sp_status::$name => $message, )*
                }
            }
        }
    };
}

status_codes! {
    SP_OK = 0: "Success.",
    SP_ERR_INVALID_ARGUMENT = 1:
        "A NULL pointer, a zero or absurd size, an unknown device, a bad enum value or option.",
    SP_ERR_OUT_OF_MEMORY = 2:
        "The device, the memory limit or a pool's limit has no room, even after freeing caches.",
    SP_ERR_UNKNOWN_POINTER = 3:
        "The pointer was not returned by slotpool, is not the start of an allocation, or was \
         already freed.",
    SP_ERR_UNKNOWN_POOL = 4: "No pool with this id exists on this device.",
    SP_ERR_INVALID_STATE = 5:
        "The call is not valid now (pool already released, no route to end, already \
         initialised).",
    SP_ERR_BACKEND_UNAVAILABLE = 6:
        "The requested backend cannot be used here (no CUDA driver, no device).",
    SP_ERR_DEVICE = 7: "The backend failed (a CUDA driver error).",
    SP_ERR_NOT_INITIALIZED = 8:
        "The library could not be initialised from the environment (lazy initialisation \
         failed).",
    SP_ERR_SHUTDOWN = 9: "sp_shutdown was called; the library serves no more calls.",
    SP_ERR_PANIC = 10: "A bug: a panic inside slotpool was caught at the C boundary.",
    SP_ERR_CONFIG = 11: "A configuration string was rejected (unknown key, bad value).",
    SP_ERR_POOL_PAUSED = 12:
        "The pool is paused (sp_pool_pause): nothing is allocated from it until it is resumed.",
}

/// What `sp_status_name` returns for a value that is no status code.
pub const UNRECOGNIZED_STATUS: &CStr = c"SP_ERR_UNRECOGNIZED";

impl sp_status {
    /// The code as C sees it.
    pub const fn code(self) -> c_int {
        self as c_int
    }

    /// The status whose code is `code`, if any: how a value returned through a C function
    /// pointer (any `int`) is read back without assuming it is in range.
    pub fn from_code(code: c_int) -> Option<sp_status> {
        Self::ALL.iter().copied().find(|s| s.code() == code)
    }

    /// The name of `code`, or [`UNRECOGNIZED_STATUS`] for a value that is no code.
    pub fn name_of(code: c_int) -> &'static CStr {
        Self::from_code(code).map_or(UNRECOGNIZED_STATUS, sp_status::name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_dense_and_named_after_their_variants() {
        for (i, s) in sp_status::ALL.iter().enumerate() {
            assert_eq!(s.code() as usize, i, "{s:?}");
            assert_eq!(s.name().to_str().unwrap(), format!("{s:?}"));
            assert_eq!(sp_status::from_code(s.code()), Some(*s));
            assert!(s.message().ends_with('.'), "{s:?}");
        }
        assert_eq!(sp_status::ALL.len(), 13);
        assert_eq!(
            sp_status::name_of(2).to_str().unwrap(),
            "SP_ERR_OUT_OF_MEMORY"
        );
        let past = sp_status::ALL.len() as c_int;
        for unknown in [-1, past, 1000, c_int::MIN, c_int::MAX] {
            assert_eq!(sp_status::from_code(unknown), None);
            assert_eq!(sp_status::name_of(unknown), UNRECOGNIZED_STATUS);
        }
    }
}
