package testutil

import (
	"os"
	"os/exec"
	"testing"
)

// RequireRedisEnv makes the tests that need a redis-server fail rather than skip when
// it is missing, when set to anything but "" or "0"; CI sets it.
const RequireRedisEnv = "VMARENA_REQUIRE_REDIS"

// NeedRedis returns the paths of redis-server and redis-cli, or skips tb when either
// is not installed, unless the environment requires them (RequireRedisEnv): then it
// fails tb.
func NeedRedis(tb testing.TB) (server, cli string) {
	tb.Helper()
	server, err1 := exec.LookPath("redis-server")
	cli, err2 := exec.LookPath("redis-cli")
	if err1 == nil && err2 == nil {
		return server, cli
	}
	if v := os.Getenv(RequireRedisEnv); v != "" && v != "0" {
		tb.Fatalf("%s is set but redis-server or redis-cli is not installed (apt-get install redis-server redis-tools)", RequireRedisEnv)
	}
	tb.Skipf("redis-server or redis-cli not installed (apt-get install redis-server redis-tools); set %s=1 to require them", RequireRedisEnv)
	return "", ""
}
