//! The long help of `slotpool replay`: the trace formats, the actions and the configuration
//! layers, for users (docs/cli.md says the same at more length).

use slotpool_core::Config;

use crate::settings::{ENV_CONF, ENV_LOG};
use crate::trace::Action;

/// Shown after the options by `slotpool replay --help`.
pub fn replay_after_help() -> String {
    format!(
        "\
TRACE FORMATS (told apart by content, gzip-compressed or not; `-` reads standard input):
  CSV: a header line naming the columns action,addr,size,stream (in any order; other columns
  are ignored), then one event per line, sizes in bytes:
      action,addr,size,stream
      segment_alloc,139637976727552,20971520,0
      alloc,139637976727552,3145733,0
      free_completed,139637976727552,3145733,0
  `addr` names a block (an alloc pairs with the next free of the same addr); an alloc's size is
  the requested size; `stream` is an opaque cudaStream_t value.
  PyTorch snapshot: the pickle that torch.cuda.memory._dump_snapshot() writes. The entries of
  device_traces[--device] are read (default: the first device with entries); their stack
  frames are skipped while reading.

ACTIONS: {actions}.
  The replay allocates at `alloc` and frees at `free_completed` (at `free_requested` when the
  trace has no `free_completed`). The segment actions are PyTorch's own reserved memory, shown
  as `torch peak reserved` and drawn by --plot. `variant_begin` (size: the variant's number),
  `capture_begin` and `capture_end` mark CUDA-graph variants and captures: replay such a trace
  with --variants, which pools the captures as PyTorch does; a plain replay warns.

CONFIGURATION: the replay's defaults, then {ENV_CONF}, then --conf, then --mode (each layer's
  key:value pairs override the layer before; a --mode that disagrees with a growth set by
  --conf is refused). Keys: {keys}.
  --json echoes every key of the configuration in effect under `config` (null: unset).
  {ENV_LOG}=<filter> (e.g. `info`, `slotpool_core=debug`) logs to stderr, as in the library.

EXIT STATUS: 0 on success; 2 on bad arguments, an unreadable or malformed trace, or a failed
  replay, with one line on stderr starting `error:`.",
        actions = Action::names(),
        keys = Config::KEYS.join(", "),
    )
}
