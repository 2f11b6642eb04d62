//go:build tools

// Package tools names Helm's main package, which scripts/operator-bins builds to lint and
// template the chart in deploy/chart, so that `go mod tidy` keeps every module it needs in
// go.mod/go.sum.
package tools

import (
	_ "helm.sh/helm/v3/cmd/helm"
)
