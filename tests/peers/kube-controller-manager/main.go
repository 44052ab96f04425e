// Command kube-controller-manager is the upstream controller manager (k8s.io/kubernetes
// v1.37.2), built as a sysdra test peer: its resourceclaim controller turns a Pod's
// ResourceClaimTemplate or extended-resource request into a ResourceClaim on the real node.
package main

import (
	"os"
	_ "time/tzdata"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/kube-controller-manager/app"
)

func main() {
	os.Exit(cli.Run(app.NewControllerManagerCommand()))
}
