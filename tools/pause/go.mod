// The real cluster's pod sandbox program (tools/pause-image.sh): standard library only.
module splitproxy.dev/tools/pause

go 1.26.0
