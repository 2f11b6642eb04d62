//go:build tools

// Package tools names the etcd main package (go.etcd.io/etcd/server/v3 is the
// `etcd` binary) that scripts/upstream-bins builds, so that `go mod tidy`
// keeps every module it needs in go.mod/go.sum.
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
)
