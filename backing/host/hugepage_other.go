//go:build !linux

package host

import "errors"

// Transparent huge pages are a Linux feature: elsewhere nothing is asked for.

func hugeAnon() hugeMode  { return hugeMode{why: "transparent huge pages are a Linux feature"} }
func hugeShmem() hugeMode { return hugeMode{why: "transparent huge pages are a Linux feature"} }

func hugeReporting() string { return "" }

func hugeAdvise(addr uintptr, n int, huge bool) error { return errors.ErrUnsupported }

func hugeBytes(lo, hi uintptr) (HugePageBytes, error) { return HugePageBytes{}, errors.ErrUnsupported }
