//go:build !linux

package cudatest

import "errors"

// fakeShmSupported is false: there is no memfd here, so the fake's device exports
// nothing (attribute 103 reads 0).
const fakeShmSupported = false

// fakeShm is never made here.
type fakeShm struct{ data []byte }

func newFakeShm(int32, uintptr) (*fakeShm, error) { return nil, errors.ErrUnsupported }

func identifyFakeShm(int) (int32, uintptr, bool) { return 0, 0, false }

func openFakeShm(int, uintptr) (*fakeShm, error) { return nil, errors.ErrUnsupported }

func (s *fakeShm) dup() (int, error) { return 0, errors.ErrUnsupported }

func (s *fakeShm) close() {}
