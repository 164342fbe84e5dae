// Python ints as addresses, for the bindings' lists of `storage._cdata` (module.cpp): graph
// trees pass thousands at every branch switch, and PyLong_AsVoidPtr costs two calls and their
// checks an int. The usual int (exact, not negative, at most two 30-bit digits: every user-space
// address) is read from its digits instead, as Cython and nanobind read ints, for the CPython
// layouts known here (3.11's signed size, 3.12 and 3.13's tag); anything else takes the
// general path.
#pragma once

#include <Python.h>

#include <cstdint>

namespace slotpool_torch {

// The value of `o` when it is such an int (true), else false and nothing read but its type.
inline bool int_as_address(PyObject* o, uintptr_t* out) {
#if PyLong_SHIFT == 30 && PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030E0000
  if (!PyLong_CheckExact(o)) {
    return false;
  }
  const auto* l = reinterpret_cast<const PyLongObject*>(o);
#if PY_VERSION_HEX >= 0x030C0000
  // lv_tag: the digit count above _PyLong_NON_SIZE_BITS, the sign below (2: negative).
  const uintptr_t tag = l->long_value.lv_tag;
  if ((tag & _PyLong_SIGN_MASK) == 2) {
    return false;
  }
  const uintptr_t digits = tag >> _PyLong_NON_SIZE_BITS;
  const digit* d = l->long_value.ob_digit;
#else
  // ob_size: the digit count, negative for a negative int.
  const Py_ssize_t size = Py_SIZE(l);
  if (size < 0) {
    return false;
  }
  const auto digits = static_cast<uintptr_t>(size);
  const digit* d = l->ob_digit;
#endif
  if (digits > 2) {
    return false;
  }
  uintptr_t v = digits > 0 ? d[0] : 0;
  if (digits == 2) {
    v |= static_cast<uintptr_t>(d[1]) << PyLong_SHIFT;
  }
  *out = v;
  return true;
#else
  (void)o;
  (void)out;
  return false;
#endif
}

}  // namespace slotpool_torch
