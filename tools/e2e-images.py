#!/usr/bin/env python3
"""Writes the images Kubernetes' own Service e2e tests run, from what this machine has: nothing
is pulled from a registry. Used by tools/e2e.sh.

  e2e-images.py OUT AGNHOST_BINARY PAUSE_BINARY

- registry.k8s.io/e2e-test-images/agnhost:2.66.1: the agnhost binary built at v1.37.2 from the
  Go module proxy (`k8s.io/kubernetes/test/images/agnhost`), plus the tools the tests run inside
  it through `sh -c` (upstream installs them from Alpine): busybox (Debian's busybox-static: sh
  and the core utilities), and Debian's curl, wget, nc (netcat-openbsd), bash, ss (iproute2)
  and socat with every shared library they load. Entrypoint /agnhost, command `pause`, as upstream.
- registry.k8s.io/pause:3.10.2: the cluster's own pause program (tools/pause), under the name
  the tests ask for.

The names are the ones e2e.test v1.37.2 asks for (test/utils/image/manifest.go); the kubelet
never pulls them (they are imported into every node's containerd, and the tests' pods use
IfNotPresent).
"""
import os, subprocess, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oci_image  # noqa: E402

AGNHOST = ("registry.k8s.io/e2e-test-images", "agnhost", "2.66.1")
PAUSE = ("registry.k8s.io", "pause", "3.10.2")
# Debian binaries the tests call inside agnhost pods, where upstream's Alpine image has them.
TOOLS = {
    "/usr/bin/curl": "usr/bin/curl",
    "/usr/bin/nc.openbsd": "usr/bin/nc",
    "/bin/bash": "bin/bash",
    "/bin/ss": "usr/bin/ss",
    "/usr/bin/socat": "usr/bin/socat",
    # GNU wget: busybox 1.35's wget (Debian 12) crashes on `-T`, which the tests pass.
    "/usr/bin/wget": "usr/bin/wget",
}


def read(path):
    with open(path, "rb") as f:
        return f.read()


def libraries(binary):
    """The shared libraries `binary` loads (ldd), as absolute paths, including the loader."""
    out = subprocess.run(["ldd", binary], check=True, capture_output=True, text=True).stdout
    libs = []
    for line in out.splitlines():
        words = line.split()
        if "=>" in words and len(words) >= 3 and words[2].startswith("/"):
            libs.append(words[2])
        elif words and words[0].startswith("/"):
            libs.append(words[0])
    return libs


def dirs_of(path):
    parts = path.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def main():
    out, agnhost, pause = sys.argv[1:4]
    commit = "k8s.io/kubernetes v1.37.2"
    files = {"agnhost": (0o755, read(agnhost)), "etc/passwd": (0o644, oci_image.PASSWD),
             "etc/group": (0o644, oci_image.GROUP), "bin/busybox": (0o755, read("/bin/busybox"))}
    links = {}
    applets = subprocess.run(["/bin/busybox", "--list"], check=True, capture_output=True,
                             text=True).stdout.split()
    for applet in applets:
        links["bin/" + applet] = "/bin/busybox"
    # The shell is bash, not busybox's: busybox's ash runs its own applets before PATH (Debian
    # builds it "standalone"), so `sh -c 'nc -v ...'` would get busybox's nc, not netcat.
    links["bin/sh"] = "/bin/bash"
    for src, dest in TOOLS.items():
        files[dest] = (0o755, read(src))
        links.pop("bin/" + os.path.basename(dest), None)
        for lib in libraries(src):
            real = os.path.realpath(lib)
            files[real.lstrip("/")] = (0o755, read(real))
            # The name the binary asks for, under /lib and /usr/lib alike (there is no
            # ld.so.cache in the image; the loader searches both).
            name = os.path.basename(lib)
            for alias in (lib, "/usr" + lib if lib.startswith("/lib") else lib):
                if alias != real:
                    links[alias.lstrip("/")] = real
            if os.path.dirname(real) != os.path.dirname(lib):
                links[os.path.join(os.path.dirname(real), name).lstrip("/")] = real
    entries = []
    seen_dirs = set()
    for path in list(files) + list(links):
        for d in dirs_of(path):
            if d and d not in seen_dirs:
                seen_dirs.add(d)
    for d in sorted(seen_dirs):
        entries.append((d, 0o755, None))
    for path, (mode, data) in files.items():
        entries.append((path, mode, data))
    for path, target in links.items():
        if path not in files and path not in seen_dirs:
            entries.append((path, 0o777, ("symlink", target)))
    repo, name, tag = AGNHOST
    digest, dest = oci_image.write_image(
        out, repo, commit, name, tag,
        "agnhost v1.37.2 for Kubernetes' e2e tests, with busybox and Debian's curl, nc, bash, ss, socat",
        entries, "0", ["/agnhost"], cmd=["pause"],
        env=("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",),
        author="tools/e2e-images.py")
    print(f"{repo}/{name}:{tag}", digest, dest)
    repo, name, tag = PAUSE
    digest, dest = oci_image.write_image(
        out, repo, commit, name, tag, "the cluster's pause program under the e2e tests' name",
        [("pause", 0o755, read(pause))], "65535:65535", ["/pause"],
        author="tools/e2e-images.py")
    print(f"{repo}/{name}:{tag}", digest, dest)


if __name__ == "__main__":
    main()
