// Command kube-scheduler is the upstream Kubernetes scheduler (k8s.io/kubernetes v1.37.2),
// built as a sysdra test peer: it allocates ResourceClaims with the same structured
// allocator as tests/peers/allocator, against the real API server.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/kube-scheduler/app"
)

func main() {
	os.Exit(cli.Run(app.NewSchedulerCommand()))
}
