//go:build tools

// Package tools names promtool's main package, which scripts/operator-bins builds to check
// and unit-test the alert rules in deploy/prometheus, so that `go mod tidy` keeps every module
// it needs in go.mod/go.sum.
package tools

import (
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
