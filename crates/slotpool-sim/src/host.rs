//! Pinned host buffers (`alloc_host`) and the copies between them and device memory, for the
//! backups of paused pools.

use std::collections::HashMap;

use slotpool_core::{DeviceError, DevicePtr, DeviceResult, HostBuffer};

use crate::bytes::Store;
use crate::config::Backing;
use crate::memory::Memory;

/// Copies move this many bytes at a time.
const STEP: u64 = 64 << 10;

/// One pinned buffer: its size and (sparse) bytes.
#[derive(Debug)]
struct Buffer {
    size: u64,
    bytes: Store,
}

/// Every live host buffer. Handles are never reused.
#[derive(Debug, Default)]
pub(crate) struct HostMemory {
    buffers: HashMap<u64, Buffer>,
    next: u64,
    /// Bytes of live buffers.
    pub(crate) bytes: u64,
}

fn invalid<T>(why: String) -> DeviceResult<T> {
    Err(DeviceError::InvalidArgument(why))
}

impl HostMemory {
    pub(crate) fn alloc(&mut self, size: u64) -> DeviceResult<HostBuffer> {
        if size == 0 {
            return invalid("alloc_host: size 0".into());
        }
        self.next += 1;
        self.buffers.insert(
            self.next,
            Buffer {
                size,
                bytes: Store::new(0),
            },
        );
        self.bytes += size;
        Ok(HostBuffer(self.next))
    }

    pub(crate) fn free(&mut self, buf: HostBuffer) -> DeviceResult<()> {
        match self.buffers.remove(&buf.0) {
            Some(b) => {
                self.bytes -= b.size;
                Ok(())
            }
            None => invalid(format!("free_host: unknown host buffer {}", buf.0)),
        }
    }

    fn buffer(
        &mut self,
        call: &str,
        buf: HostBuffer,
        offset: u64,
        size: u64,
    ) -> DeviceResult<&mut Buffer> {
        let Some(b) = self.buffers.get_mut(&buf.0) else {
            return invalid(format!("{call}: unknown host buffer {}", buf.0));
        };
        if offset.checked_add(size).is_none_or(|end| end > b.size) {
            return invalid(format!(
                "{call}: {size} bytes at offset {offset} overrun a host buffer of {}",
                b.size
            ));
        }
        Ok(b)
    }

    /// Device memory at `src` to `buf` at `offset`; all of it must be mapped.
    pub(crate) fn copy_to_host(
        &mut self,
        memory: &Memory,
        buf: HostBuffer,
        offset: u64,
        src: DevicePtr,
        size: u64,
    ) -> DeviceResult<()> {
        let b = self.buffer("copy_to_host", buf, offset, size)?;
        if memory.backing() == Backing::Accounting {
            return Ok(());
        }
        // Check the whole range first: a failed copy changes nothing.
        memory
            .accessible(src, size)
            .map_err(|e| DeviceError::InvalidArgument(format!("copy_to_host: {e}")))?;
        let mut done = 0;
        while done < size {
            let n = STEP.min(size - done);
            let data = memory
                .read(src + done, n as usize)
                .map_err(|e| DeviceError::InvalidArgument(format!("copy_to_host: {e}")))?;
            b.bytes.write_from(offset + done, &data);
            done += n;
        }
        Ok(())
    }

    /// `buf` at `offset` to device memory at `dst`; all of it must be mapped.
    pub(crate) fn copy_from_host(
        &mut self,
        memory: &mut Memory,
        dst: DevicePtr,
        buf: HostBuffer,
        offset: u64,
        size: u64,
    ) -> DeviceResult<()> {
        let b = self.buffer("copy_from_host", buf, offset, size)?;
        if memory.backing() == Backing::Accounting {
            return Ok(());
        }
        memory
            .accessible(dst, size)
            .map_err(|e| DeviceError::InvalidArgument(format!("copy_from_host: {e}")))?;
        let mut data = vec![0; STEP.min(size) as usize];
        let mut done = 0;
        while done < size {
            let n = STEP.min(size - done) as usize;
            b.bytes.read_into(offset + done, &mut data[..n]);
            memory
                .write(dst + done, &data[..n])
                .map_err(|e| DeviceError::InvalidArgument(format!("copy_from_host: {e}")))?;
            done += n as u64;
        }
        Ok(())
    }
}
