//go:build tools

// Package tools names the CoreDNS main package (the module's root is the
// `coredns` binary) that scripts/upstream-bins builds, so that `go mod tidy`
// keeps every module it needs in go.mod/go.sum.
package tools

import (
	_ "github.com/coredns/coredns"
)
