// Package kronk plugs vmarena's session byte store (package snapshot) into Kronk
// (github.com/ardanlabs/kronk v1.32.6), a Go SDK and server over llama.cpp: its
// Incremental Message Cache keeps each session's KV state in a kvstorage.Store
// between requests, and [Factory] hands it snapshot stores that share one budget
// and give their memory back on Reset.
//
// It is a module of its own, so that Kronk's dependency graph and its Go 1.27
// requirement stay out of vmarena's module: build and test it with
// GOTOOLCHAIN=go1.27.3 (see README.md). Its tests run the cases of Kronk's own
// tests of its RAM store (sdk/kronk/kvstorage/ram/ram_test.go) that hold for any
// kvstorage.Store unchanged on a snapshot.Store (kronkram/), replace those about
// the RAM store's capacity policy with tests of their own names, and its
// benchmark compares the two stores under an IMC-like load.
package kronk
