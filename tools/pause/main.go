// Command pause is the pod sandbox of tools/cluster.sh's nodes: it holds the pod's namespaces by
// doing nothing until the runtime asks it to stop. Built locally (CGO_ENABLED=0, static) because
// the cluster pulls nothing from the internet. As PID 1 of the sandbox it also reaps the zombies
// of processes that share its PID namespace.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	children := make(chan os.Signal, 16)
	signal.Notify(children, syscall.SIGCHLD)
	for {
		select {
		case <-stop:
			os.Exit(0)
		case <-children:
			for {
				var status syscall.WaitStatus
				pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
				if pid <= 0 || err != nil {
					break
				}
			}
		}
	}
}
