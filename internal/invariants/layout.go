package invariants

// On64Bit is 1 where pointers are 8 bytes and 0 elsewhere. A layout claim made for
// 64-bit platforms multiplies its difference by it, so that it is checked there and
// holds trivially elsewhere:
//
//	var _ [1]struct{} = [(int(unsafe.Sizeof(event{}))-152)*invariants.On64Bit + 1]struct{}{}
//
// fails to compile on a 64-bit platform unless event is 152 bytes.
const On64Bit = int(^uintptr(0) >> 63)
